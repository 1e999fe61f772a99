"""Fixtures for the built-in server tests: the tiny model, its saved directory, and a live server on it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny import SERVED_NAME, build_tiny_model, build_tokenizer
from transformers import Qwen3ForCausalLM

from asyncrl.server.process import ServerProcess, free_port


@pytest.fixture(scope="session")
def tiny_model() -> Qwen3ForCausalLM:
    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_model().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@dataclass(frozen=True)
class LiveServer:
    base_url: str
    model_dir: Path
    process: ServerProcess


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`python -m asyncrl.engine` as a real subprocess on a free port, stopped when the module ends."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(tiny_model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port), "--device", "cpu", "--max-num-seqs", "32",
            "--weights-dir", str(weights_root)]  # fmt: skip
    log_path = tmp_path_factory.mktemp("server-log") / "server.log"
    # One intra-op thread: on shared, busy CPU cores it decodes the tiny model several times faster.
    env = {"OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"
    with ServerProcess(argv, base_url=url, log_path=log_path, env=env, startup_timeout_s=120) as process:
        yield LiveServer(process.base_url, tiny_model_dir, process)
