"""`asyncrl serve RUN_DIR`: the server answers vLLM's completion API and OpenAI's chat completions with the run's
final model under a short name and the run's overrides, its state-changing routes need the token it prints, and no
process outlives the CLI, whether it is interrupted (SIGINT) or killed outright (SIGKILL)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.client import auth_headers
from asyncrl.serving.process import free_port

from .helpers import kill_marked, start_cli, wait_no_marked

pytestmark = pytest.mark.e2e


def wait_healthy(url: str, proc, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_serve_answers_then_leaves_nothing_running(random_tiny_model_dir, tmp_path, stop_signal, server_token):
    port = free_port()
    run = tmp_path / "run-a"
    shutil.copytree(random_tiny_model_dir, run / "model")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(f"- server.max_num_seqs=3\n- hydra.run.dir={run}\n")
    proc, marker = start_cli(["serve", str(run), f"server.port={port}", f"trainer.output_dir={tmp_path}"])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        body = {"model": "run-a/model", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 1.0,
                "logprobs": 2, "seed": 1, "return_token_ids": True}  # fmt: skip
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        tokens = choice["token_ids"]
        assert 1 <= len(tokens) <= 4 and len(choice["logprobs"]["token_logprobs"]) == len(tokens)
        chat = {"model": "run-a/model", "messages": [{"role": "user", "content": "1 + 2 ="}], "max_tokens": 4}
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()  # OpenAI clients' route
        assert answer["choices"][0]["message"]["role"] == "assistant" and answer["usage"]["completion_tokens"] >= 1
        assert httpx.post(f"{url}/resume").status_code == 401  # the CLI's token: the test session's, inherited
        assert httpx.post(f"{url}/resume", headers=auth_headers()).status_code == 200
        printed = _lines_until(proc, "attach with: ")  # the CLI prints them once it saw the server healthy itself
        proc.send_signal(stop_signal)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say where it stuck: the CLI's output and the server's log
            proc.kill()
            log = (tmp_path / "logs" / "server.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"the CLI outlived {stop_signal.name} by 60 s; its output:\n{proc.stdout.read()}\nlog:\n{log}")
        output = printed + proc.stdout.read()
        assert f"serving {run}/model as 'run-a/model'" in output and "--max-num-seqs 3" in output, output
        attach = re.search(r"export ASYNCRL_SERVER_TOKEN=(\S+); asyncrl train .* server.weights_dir=(\S+)", output)
        assert attach is not None and attach[1] == server_token, output
        if stop_signal == signal.SIGINT:
            assert "server stopped" in output and not Path(attach[2]).exists()  # its weights directory went too
        else:
            shutil.rmtree(attach[2])  # SIGKILL skips the CLI's exit handlers: its empty weights directory stays
        assert wait_no_marked(marker) == []
    finally:
        proc.kill()
        kill_marked(marker)


def _lines_until(proc: subprocess.Popen[str], marker: str) -> str:
    """What the CLI printed up to and including its first line holding ``marker`` (or until its output ends)."""
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if marker in line:
            break
    return "".join(lines)
