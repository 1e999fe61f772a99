"""Hub ids before anything loads: which values are Hub ids, and what one probe of an endpoint that does not answer
switches on."""

from __future__ import annotations

import os

import datasets.config
import pytest
from huggingface_hub import constants

from asyncrl.hub import OFFLINE_BY_ENV, is_hub_id, unreachable
from asyncrl.serving.process import free_port


@pytest.fixture
def fresh_probe(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """unreachable() asks again, and the offline switches it flips are put back afterwards."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # recorded, so that the test's value is undone too
    unreachable.cache_clear()
    yield monkeypatch
    unreachable.cache_clear()


def test_hub_ids_are_what_no_path_can_mean(tmp_path):
    assert is_hub_id("Qwen/Qwen3-4B") and is_hub_id("gpt2")
    for path in ("./model", "/abs/model", "~/model", "runs/a/model", str(tmp_path)):
        assert not is_hub_id(path), path


def test_offline_mode_answers_without_a_probe(fresh_probe):
    fresh_probe.setattr(constants, "HF_HUB_OFFLINE", True)
    fresh_probe.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a probe would fail: it is not asked
    assert unreachable() == OFFLINE_BY_ENV


def test_an_endpoint_that_does_not_answer_turns_offline_mode_on(fresh_probe):
    """One probe of a closed port: the reason names the endpoint, and the libraries and child processes go offline,
    so a cached model then loads without the Hub's retries."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    fresh_probe.setattr(constants, "HF_HUB_OFFLINE", False)
    fresh_probe.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    fresh_probe.setattr(constants, "ENDPOINT", endpoint)
    fresh_probe.delenv("HF_HUB_OFFLINE")
    assert unreachable() == f"no answer from {endpoint}: ConnectError"
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == "1"
