"""The Hub ids a run reads, and the check that refuses one this machine can neither find nor fetch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.hub import OFFLINE_BY_ENV
from asyncrl.hub_sources import check_hub_sources, hub_sources


def _cache_model(hub_cache: Path, repo_id: str, file: str = "config.json") -> None:
    """The layout huggingface_hub downloads into: a snapshot per commit, refs/main naming it."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / file).write_text(json.dumps({"model_type": "qwen3"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_the_model_rewards_and_data_read_from_the_hub_are_listed():
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


def test_a_reward_models_revision_and_tokenizer_are_read_from_the_hub(monkeypatch, tmp_path):
    """TRL's reward_processing_classes: a tokenizer from another repository, which the offline check must find too;
    a tokenizer's repository may hold no config.json."""
    rm = "reward_funcs=[{name: reward_model, path: org/rm, revision: v2, tokenizer: org/rm-tokenizer}]"
    config = to_config(compose([rm]))
    assert [(s.key, s.repo_id, s.revision) for s in hub_sources(config)] == [
        ("reward_funcs[0].path", "org/rm", "v2"),
        ("reward_funcs[0].tokenizer", "org/rm-tokenizer", None),
    ]
    monkeypatch.setattr("asyncrl.hub_sources.unreachable", lambda: OFFLINE_BY_ENV)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config.model.name_or_path = str(tmp_path)  # a local model, data and reward model: only the tokenizer is asked
    config.data.path = str(tmp_path)
    config.reward_funcs = [{"name": "reward_model", "path": str(tmp_path), "tokenizer": "org/rm-tokenizer"}]
    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]\.tokenizer=org/rm-tokenizer: not on this machine"):
        check_hub_sources(config)
    _cache_model(tmp_path / "hub", "org/rm-tokenizer", "tokenizer_config.json")
    assert check_hub_sources(config) is None


def test_offline_a_hub_id_is_refused_unless_the_cache_has_it(monkeypatch, tmp_path):
    monkeypatch.setattr("asyncrl.hub_sources.unreachable", lambda: OFFLINE_BY_ENV)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
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
