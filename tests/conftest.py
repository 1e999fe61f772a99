"""Session fixtures shared across test folders: a tiny random-init model with the embedded default's
tokenizer and chat template, and arithmetic data in DeepMath's schema (nothing is downloaded)."""

from __future__ import annotations

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
