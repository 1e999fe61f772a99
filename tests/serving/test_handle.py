"""An attached server (server.launch=false) is dead only when it refuses /health, not when it answers late; a
booting one (a trainer rank's view of the server the CLI launched) is ready once it answers /health."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from fastapi import FastAPI, Response

from asyncrl.run_plan import ServerCommand
from asyncrl.serving.handle import AttachedServer, LaunchedServer
from asyncrl.serving.process import ServerStartError, free_port


def health_app(delay_s: float, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        await asyncio.sleep(delay_s)
        return Response(status_code=status)

    return app


def test_a_late_answer_is_a_busy_server_not_a_dead_one(serve_app):
    with serve_app(health_app(delay_s=1.0)) as base_url:
        server = AttachedServer(base_url, timeout_s=10)
        server.health_timeout_s = 0.1
        assert server.is_alive()


def test_a_refused_connection_or_an_error_status_is_dead(serve_app):
    assert not AttachedServer(f"http://127.0.0.1:{free_port()}", timeout_s=10).is_alive()
    with serve_app(health_app(delay_s=0.0, status=500)) as base_url:
        assert not AttachedServer(base_url, timeout_s=10).is_alive()


def booting_app(healthy_after_s: float) -> FastAPI:
    """/health answers 503 (vLLM while its engine starts) until ``healthy_after_s`` from the first request."""
    app, started = FastAPI(), []

    @app.get("/health")
    async def health() -> Response:
        started.append(started[0] if started else time.monotonic())
        return Response(status_code=200 if time.monotonic() - started[0] >= healthy_after_s else 503)

    return app


def test_a_booting_server_is_ready_once_healthy_and_then_at_once(serve_app):
    with serve_app(booting_app(healthy_after_s=1.0)) as base_url:
        server = AttachedServer(base_url, timeout_s=30, booting=True)
        start = time.monotonic()
        server.ready()
        assert time.monotonic() - start >= 0.9
        start = time.monotonic()
        server.ready()
        assert time.monotonic() - start < 0.1


def test_a_booting_server_that_never_answers_names_the_timeout_key():
    server = AttachedServer(f"http://127.0.0.1:{free_port()}", timeout_s=1.0, booting=True)
    with pytest.raises(ServerStartError, match=r"after 1s \(server.timeout\)"):
        server.ready()


def test_a_vllm_refusing_its_share_at_startup_names_the_key_that_sets_it(tmp_path):
    """vLLM's own advice ("Decrease GPU memory utilization") names its flag; the line names asyncrl's key and the
    share the run gave it. Another backend, or another cause, gets no such ending."""
    error = ("ValueError: Free memory on device cuda:0 (60.78/79.18 GiB) on startup is less than desired GPU "
             "memory utilization (0.77, 60.97 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
             "other processes.")  # fmt: skip
    lines = {}
    for backend, said in (("vllm", error), ("builtin", error), ("vllm", "ValueError: something else")):
        argv = [sys.executable, "-c", f"import sys; print({said!r}, file=sys.stderr); sys.exit(1)",
                "--gpu-memory-utilization", "0.77"]  # fmt: skip
        command = ServerCommand(backend, argv, {})
        server = LaunchedServer(command, f"http://127.0.0.1:{free_port()}", tmp_path / f"{len(lines)}.log", 30)
        with pytest.raises(ServerStartError) as failed:
            with server:
                pass
        lines[(backend, said == error)] = str(failed.value)
    assert lines[("vllm", True)].endswith(
        "; give vLLM less of the GPU with server.gpu_memory_utilization (it had 0.77)"
    )
    assert "server.gpu_memory_utilization" not in lines[("builtin", True)] + lines[("vllm", False)]
