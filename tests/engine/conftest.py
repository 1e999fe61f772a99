"""Fixtures for the built-in server tests: the tiny model, its saved directory, and a live server on it."""

from pathlib import Path

import pytest
from tiny import live_server, tiny_model, tiny_model_dir  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``asyncrl.assets.tiny_vlm``'s checkpoint (seed 0): a Qwen3.5 vision-language model that takes images."""
    from asyncrl.assets.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0)
