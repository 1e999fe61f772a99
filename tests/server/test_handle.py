"""An attached server (server.launch=false) is dead only when it refuses /health, not when it answers late."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Response

from asyncrl.server.handle import AttachedServer
from asyncrl.server.process import free_port


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
