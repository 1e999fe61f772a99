"""Pushing to the Hub against a local endpoint that records what arrives (tests/fake_hub.py): the repository, each
commit's files and the model card, under each hub.hub_strategy; logging.log_completions_hub_repo's dataset repository,
created as the job starts; and the refusals before anything trains."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.hub_push import HubPushError, check_completions_hub, check_hub_push, pushing
from tests.fake_hub import FakeHub, serving_fake_hub

REPO = "org/tiny-arith-grpo"
REPO_KEY = "logging.log_completions_hub_repo"
EVAL = {"before": {"eval/greedy_reward": 1.0, "eval/sampled_reward": 0.25},
        "after": {"eval/greedy_reward": 1.0, "eval/sampled_reward": 0.75},
        "before_model": "base model", "before_step": 0, "after_step": 4}  # fmt: skip
MODEL_FILES = {"config.json", "model.safetensors", "README.md"}
RESUME_FILES = {"sharded/__0_0.distcp", "optimizer.pt", "rng_state.pt", "trainer_state.json", "rollout_state.json"}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with serving_fake_hub(monkeypatch) as fake:
        yield fake


def push_config(strategy: str) -> Config:
    return to_config(compose(["hub.push_to_hub=true", f"hub.hub_model_id={REPO}", f"hub.hub_strategy={strategy}",
                              "hub.hub_private_repo=true", "model.name_or_path=Qwen/Qwen3-0.6B"]))  # fmt: skip


def write_model(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")


def save_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint as the trainer publishes one: written beside its name, then renamed whole."""
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    write_model(tmp)
    for name in RESUME_FILES:
        (tmp / name).parent.mkdir(exist_ok=True)
        (tmp / name).write_bytes(b"state")
    tmp.rename(final)
    return final


def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the watcher pushed nothing"
        time.sleep(0.01)


def test_end_pushes_the_final_model_with_a_card_of_the_config_and_the_held_out_evaluation(hub, tmp_path):
    with pushing(push_config("end"), tmp_path, interval_s=0.01):
        save_checkpoint(tmp_path, 2)  # not pushed under end
        write_model(tmp_path / "model")
        (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    assert hub.created == [{"name": "tiny-arith-grpo", "organization": "org", "visibility": "private"}]
    (commit,) = hub.commits
    assert commit.summary == "End of training" and set(commit.files) == MODEL_FILES
    card = commit.files["README.md"].decode()
    assert card.startswith("---\nbase_model: Qwen/Qwen3-0.6B\n") and "library_name: transformers" in card
    assert "| reward | base model (step 0) | step 4 |" in card and "| eval/sampled_reward | 0.250 | 0.750 |" in card
    assert "```yaml\nmodel:\n  name_or_path: Qwen/Qwen3-0.6B\n" in card and "  hub_strategy: end\n" in card


@pytest.mark.parametrize(
    ("strategy", "whole"),
    [("every_save", None), ("checkpoint", "last-checkpoint"), ("all_checkpoints", "checkpoints/step_{step:06d}")],
)
def test_each_save_pushes_its_model_and_the_strategys_checkpoints_beside_training(hub, tmp_path, strategy, whole):
    """A checkpoint from before (a resumed run's) is not pushed again; one saved while training goes at once, the
    last one as the job ends, then the final model."""
    save_checkpoint(tmp_path, 1)
    with pushing(push_config(strategy), tmp_path, interval_s=0.01):
        save_checkpoint(tmp_path, 2)
        wait_for(lambda: hub.commits)
        save_checkpoint(tmp_path, 3)
        write_model(tmp_path / "model")
    saves = [f"Training in progress, step {step}" for step in (2, 3)]
    per_save = [saves[0]] * (1 + bool(whole)) + [saves[1]] * (1 + bool(whole))
    assert [c.summary for c in hub.commits] == [*per_save, "End of training"]
    assert [set(c.files) for c in hub.commits if c.summary == saves[0]][0] == MODEL_FILES  # no resume-only files
    if whole:
        pushed = set(hub.commits[1].files)
        assert pushed == {f"{whole.format(step=2)}/{name}" for name in MODEL_FILES | RESUME_FILES}
        assert "its checkpoint at step 2" in hub.commits[1].files[f"{whole.format(step=2)}/README.md"].decode()


def test_a_token_that_may_not_write_refuses_the_run_before_it_trains(hub, tmp_path):
    hub.fail_with = 403
    with pytest.raises(ConfigError) as info, pushing(push_config("end"), tmp_path):
        pytest.fail("the job ran")
    assert str(info.value).startswith(f"hub.hub_model_id={REPO}: the Hub refused to create the repository (403")
    assert "\n" not in str(info.value)


def test_a_failed_save_push_warns_and_a_failed_final_push_says_how_to_upload(hub, tmp_path, caplog):
    with pytest.raises(HubPushError) as info, pushing(push_config("every_save"), tmp_path, interval_s=0.01):
        hub.fail_with = 403  # after the repository exists
        save_checkpoint(tmp_path, 2)
        write_model(tmp_path / "model")
    assert str(info.value).endswith(f"the model is saved there: hf upload {REPO} {tmp_path / 'model'}")
    assert [r.levelno for r in caplog.records if "pushing step_000002" in r.getMessage()] == [logging.WARNING]


def completions_config(repo: str, *overrides: str) -> Config:
    return to_config(compose(["logging.log_completions=true", f"logging.log_completions_hub_repo={repo}", *overrides]))


def test_the_completions_dataset_repository_is_created_as_the_job_starts(hub, tmp_path):
    """Without hub.push_to_hub too; private as hub.hub_private_repo says; nothing else goes up from the launcher."""
    with pushing(completions_config("org/completions", "hub.hub_private_repo=true"), tmp_path):
        assert hub.created == [
            {"name": "completions", "organization": "org", "type": "dataset", "visibility": "private"}
        ]
    assert hub.commits == []


def test_a_token_that_may_not_write_the_completions_repository_refuses_the_run(hub, tmp_path):
    hub.fail_with = 403
    with pytest.raises(ConfigError) as info, pushing(completions_config("org/completions"), tmp_path):
        pytest.fail("the job ran")
    message = str(info.value)
    assert message.startswith(f"{REPO_KEY}=org/completions: the Hub refused to create the repository (403 Forbidden")
    assert message.endswith(f"or set another {REPO_KEY}") and "\n" not in message


UPLOADS = [
    (check_hub_push, ["hub.push_to_hub=true"], "hub.push_to_hub=true", "hub.push_to_hub=false"),
    (
        check_completions_hub,
        ["logging.log_completions=true", "logging.log_completions_hub_repo=completions"],
        "logging.log_completions_hub_repo=completions",
        "logging.log_completions_hub_repo=null",
    ),
]


@pytest.mark.parametrize(("check", "overrides", "setting", "off"), UPLOADS, ids=["push_to_hub", "completions"])
def test_an_upload_needs_a_hub_that_answers_and_a_token(monkeypatch, check, overrides, setting, off):
    config = to_config(compose(overrides))
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: "HF_HUB_OFFLINE=1")
    unreached = rf"^{re.escape(setting)}, but the Hub cannot be reached \(HF_HUB_OFFLINE=1\): run where it answers, or"
    with pytest.raises(ConfigError, match=rf"{unreached} set {re.escape(off)} and upload"):
        check(config)
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: None)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ConfigError, match=rf"^{re.escape(setting)} needs a Hugging Face token that may write"):
        check(config)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_test")
    check(config)
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: "never asked")
    check(to_config(compose([*overrides, off])))


def test_the_completions_can_be_uploaded_by_hand_if_the_hub_does_not_answer(monkeypatch):
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: "HF_HUB_OFFLINE=1")
    with pytest.raises(ConfigError) as info:
        check_completions_hub(completions_config("completions"))
    assert str(info.value).endswith("(hf upload completions <run_dir>/completions --repo-type dataset)")
