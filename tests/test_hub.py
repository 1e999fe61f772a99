"""Hub ids before anything loads: which values are Hub ids, what the cache holds, and what one probe of an endpoint
that does not answer switches on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets.config
import pytest
from huggingface_hub import constants

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.hub import check_hub_sources, hub_sources, is_hub_id, unreachable
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


def _cache_model(hub_cache: Path, repo_id: str) -> None:
    """The layout huggingface_hub downloads into: a snapshot per commit, refs/main naming it."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hub_ids_are_what_no_path_can_mean(tmp_path):
    assert is_hub_id("Qwen/Qwen3-4B") and is_hub_id("gpt2")
    for path in ("./model", "/abs/model", "~/model", "runs/a/model", str(tmp_path)):
        assert not is_hub_id(path), path
    config = to_config(compose(["+recipe=deepmath", "data.eval_path=trl-lib/held-out"]))
    assert [(s.key, s.repo_id, s.repo_type) for s in hub_sources(config)] == [
        ("model.name_or_path", "Qwen/Qwen3.5-2B", "model"),
        ("data.path", "trl-lib/DeepMath-103K", "dataset"),
        ("data.eval_path", "trl-lib/held-out", "dataset"),
    ]
    config.data.num_eval_prompts = 0  # no evaluation: its data is not read
    assert [s.key for s in hub_sources(config)] == ["model.name_or_path", "data.path"]
    config = to_config(compose(["reward_funcs=[{name: length}, {name: reward_model, path: org/rm}]"]))
    assert [(s.key, s.repo_id) for s in hub_sources(config)] == [("reward_funcs[1].path", "org/rm")]


def test_offline_a_hub_id_is_refused_unless_the_cache_has_it(fresh_probe, tmp_path):
    fresh_probe.setattr(constants, "HF_HUB_OFFLINE", True)
    fresh_probe.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fresh_probe.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    config = to_config(compose(["model.name_or_path=org/cached-model", "data.path=org/prompts", "data.eval_path=null"]))
    with pytest.raises(ConfigError, match=r"^model.name_or_path=org/cached-model: not on this machine .* \(HF_HUB_"
                                          r"OFFLINE=1\): give a local model directory, or run where the Hub answers "
                                          r"\(or fill the cache there: hf download org/cached-model\)$"):  # fmt: skip
        check_hub_sources(config)
    _cache_model(tmp_path / "hub", "org/cached-model")
    with pytest.raises(ConfigError, match=r"^data.path=org/prompts: .*: give a local data file or directory"):
        check_hub_sources(config)
    (tmp_path / "datasets" / "org___prompts").mkdir(parents=True)  # where datasets keeps what it loaded
    assert check_hub_sources(config) is None
    config.reward_funcs = [{"name": "reward_model", "path": "org/reward-model"}]
    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]\.path=org/reward-model: not on this machine"):
        check_hub_sources(config)


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
