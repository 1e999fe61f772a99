"""Session fixtures shared across test folders: a tiny random-init model with the embedded default's
tokenizer and chat template, and arithmetic data in DeepMath's schema (nothing is downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def random_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.assets.tiny_model import build_model, build_tokenizer, save_tiny_model

    path = tmp_path_factory.mktemp("random-tiny")
    tokenizer = build_tokenizer()
    save_tiny_model(build_model(tokenizer, seed=0), tokenizer, path)
    return path


@pytest.fixture(scope="session")
def arithmetic_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.assets.arithmetic import write_splits

    path = tmp_path_factory.mktemp("arith")
    write_splits(path, seed=0, n_train=300, n_eval=40)
    return path


@pytest.fixture(scope="module")
def tiny_server(random_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`python -m asyncrl.server` on the random tiny model (served under its path), one per test module."""
    from asyncrl.server.process import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.server", "--model", str(random_tiny_model_dir), "--port", str(port),
            "--device", "cpu", "--max-num-seqs", "16"]  # fmt: skip
    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as process:  # fmt: skip
        yield process
