"""logging.log_completions_hub_repo from the trainer's side, against a local Hub endpoint (tests/fake_hub.py): each
logging step's table arrives as a parquet file that reads back with its rows and columns, the repository loads with
``datasets`` as one table, a failing or slow Hub warns and never raises, and the key is refused without
logging.log_completions."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.trainer.completions_hub import CompletionsHub, start_completions_hub
from tests.fake_hub import USER, FakeHub, serving_fake_hub

REPO = "org/completions"
COLUMNS = ["step", "prompt", "completion", "reward", "advantage"]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with serving_fake_hub(monkeypatch) as fake:
        yield fake


def hub_config(repo: str = REPO, *overrides: str) -> Config:
    return to_config(compose(["logging.log_completions=true", f"logging.log_completions_hub_repo={repo}", *overrides]))


def record(prompt: str, completion: str, reward: float, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "completion": completion, "reward": reward, "advantage": reward - 0.5, **extra}


def wait_for(condition: Callable[[], Any], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the Hub saw nothing"
        time.sleep(0.01)


def repository(hub: FakeHub, where: Path) -> Path:
    """The files the Hub holds after its commits, written under ``where``."""
    for commit in hub.commits:
        for name, data in commit.files.items():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_bytes(data)
    return where


def test_each_step_is_a_parquet_file_of_the_dataset_repository_that_loads_as_one_table(hub, tmp_path):
    """Steps logged between two commits go in one, with the card; the second step lacks the first's log_extra column
    and brings one of its own, and the files still load as one table, here as on the Hub."""
    uploader = CompletionsHub(hub_config(), tmp_path, REPO, interval_s=3600)
    uploader.write(2, [record("1+1", "2", 1.0, parsed="2"), record("1+1", "3", 0.0, parsed=None)])
    uploader.write(4, [record("2+2", "4", 1.0, length=1)])
    uploader.close(timeout_s=10)

    (commit,) = hub.commits
    assert commit.path == f"/api/datasets/{REPO}/commit/main" and commit.summary == "Completions up to step_000004"
    assert set(commit.files) == {"data/step_000002.parquet", "data/step_000004.parquet", "README.md"}
    assert "Completions of a local model logged by an asyncrl GRPO run" in commit.files["README.md"].decode()
    step_2 = pq.read_table(io.BytesIO(commit.files["data/step_000002.parquet"]))
    assert step_2.column_names == [*COLUMNS, "parsed"]
    assert step_2.to_pylist()[1] == {"step": 2, "prompt": "1+1", "completion": "3", "reward": 0.0, "advantage": -0.5,
                                     "parsed": None}  # fmt: skip
    pushed = repository(hub, tmp_path / "hub")
    local = tmp_path / "completions"
    assert {p.relative_to(pushed): p.read_bytes() for p in pushed.rglob("*") if p.is_file()} == {
        p.relative_to(local): p.read_bytes() for p in local.rglob("*") if p.is_file()
    }
    table = datasets.load_dataset(str(pushed), split="train", cache_dir=str(tmp_path / "cache"))
    assert table.column_names == [*COLUMNS, "parsed", "length"]
    assert table["step"] == [2, 2, 4] and table["parsed"] == ["2", None, None] and table["length"] == [None, None, 1.0]


def test_a_bare_name_is_the_tokens_users_and_unique_prompts_keep_each_prompts_first_completion(hub, tmp_path):
    unique = ["logging.log_unique_prompts=true", "logging.report_to=[tensorboard]"]
    config = hub_config("completions", *unique, "model.name_or_path=Qwen/Qwen3-0.6B")
    uploader = CompletionsHub(config, tmp_path, "completions", interval_s=3600)
    uploader.write(1, [record("a", "x", 1.0), record("a", "y", 0.0), record("b", "z", 0.0)])
    uploader.close(timeout_s=10)
    (commit,) = hub.commits
    assert commit.path == f"/api/datasets/{USER}/completions/commit/main"
    assert "Completions of `Qwen/Qwen3-0.6B` logged" in commit.files["README.md"].decode()
    rows = pq.read_table(io.BytesIO(commit.files["data/step_000001.parquet"])).to_pylist()
    assert [(row["prompt"], row["completion"]) for row in rows] == [("a", "x"), ("b", "z")]


def test_a_failing_hub_warns_once_per_kind_and_the_files_go_with_the_next_commit(hub, tmp_path, caplog):
    hub.fail_with = 500
    uploader = CompletionsHub(hub_config(), tmp_path, REPO, interval_s=0.01)
    uploader.write(1, [record("a", "x", 1.0)])
    wait_for(lambda: hub.refused >= 3)
    hub.fail_with = 403
    uploader.write(2, [record("b", "y", 0.0)])
    wait_for(lambda: hub.refused >= 6)
    hub.fail_with = None
    wait_for(lambda: hub.commits)
    uploader.close(timeout_s=10)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(" (")[1].split(":")[0] for w in warnings] == ["HTTP 500", "HTTP 403"]
    assert warnings[0].startswith(f"committing completions to {REPO} on the Hub failed (HTTP 500: Server error '500")
    assert warnings[0].endswith(
        f"training goes on, and the files wait in {tmp_path / 'completions'} for the next commit"
    )
    assert {name for commit in hub.commits for name in commit.files} == {
        "data/step_000001.parquet", "data/step_000002.parquet", "README.md"}  # fmt: skip


def test_the_end_of_the_run_waits_a_bounded_time_then_says_how_to_upload_the_rest(hub, tmp_path, caplog):
    hub.delay_s = 2.0
    uploader = CompletionsHub(hub_config(), tmp_path, REPO, interval_s=3600)
    uploader.write(3, [record("a", "x", 1.0)])
    started = time.monotonic()
    uploader.close(timeout_s=0.2)
    assert time.monotonic() - started < 1.5
    folder = tmp_path / "completions"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (f"1 logging step(s) of completions did not reach {REPO} on the Hub; they are in "
                                    f"{folder}: hf upload {REPO} {folder} --repo-type dataset")  # fmt: skip
    assert (folder / "data" / "step_000003.parquet").is_file()
    uploader.thread.join(10)  # the late commit still goes while the process lives
    assert [commit.summary for commit in hub.commits] == ["Completions up to step_000003"]


def test_a_resumed_run_sends_what_the_last_launch_left(hub, tmp_path):
    hub.fail_with = 500
    first = CompletionsHub(hub_config(), tmp_path, REPO, interval_s=3600)
    first.write(1, [record("a", "x", 1.0, parsed="1")])
    first.close(timeout_s=10)  # its commit refused: the file stays on disk
    hub.fail_with = None
    uploader = CompletionsHub(hub_config(), tmp_path, REPO, interval_s=3600)
    uploader.write(2, [record("b", "y", 0.0)])
    uploader.close(timeout_s=10)
    (commit,) = hub.commits
    assert set(commit.files) == {"data/step_000001.parquet", "data/step_000002.parquet", "README.md"}
    assert "- name: parsed" in commit.files["README.md"].decode()  # the card still lists the first launch's column


def test_the_key_needs_log_completions_and_nothing_starts_without_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        to_config(compose([f"logging.log_completions_hub_repo={REPO}"]))
    assert str(info.value) == (
        f"logging.log_completions_hub_repo={REPO} uploads the completions that logging.log_completions=true logs: "
        "set it, or drop logging.log_completions_hub_repo"
    )
    assert start_completions_hub(to_config(compose(["logging.log_completions=true"])), tmp_path) is None
