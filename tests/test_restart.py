"""The restart decision with injected failures: a dead process (or a hung server) restarts the job from the newest
checkpoint that resumes (a damaged newer one set aside), up to trainer.max_restarts times, each restart recorded;
other failures, and the one past the budget, end the run as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.config.errors import ConfigError
from asyncrl.restart import run_restarting
from asyncrl.serving.process import ServerStartError
from asyncrl.serving.watchdog import HealthWatchdog
from asyncrl.trainer.assembler import RolloutWorkerError
from asyncrl.trainer.exits import restart_count
from asyncrl.trainer.launcher import TrainerRankError


def checkpoint(output_dir: Path, step: int) -> Path:
    """The files ``check_checkpoint`` reads, whole (the weights and states of a one-tensor model)."""
    path = output_dir / "checkpoints" / f"step_{step:06d}"
    (path / "sharded").mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "model_version": step, "prompts_consumed": 0}))
    (path / "rollout_state.json").write_text(json.dumps({"prompt_index": 0}))
    torch.save({"scheduler": {}}, path / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, path / "rng_state.pt")
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    return path


class Job:
    """An attempt that fails with ``failures`` in turn, then succeeds; it records the checkpoint each resumed."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures, self.resumes = list(failures), []

    def __call__(self, resume: str | None) -> None:
        self.resumes.append(resume)
        if self.failures:
            raise self.failures.pop(0)


def restarting(job: Job, run_dir: Path, max_restarts: int, lines: list[str]) -> int:
    return run_restarting(job, run_dir, run_dir, max_restarts, resume="latest", clock=lambda: 1234.0,
                          report=lambda line, exc: lines.append(line))  # fmt: skip


def test_a_dead_worker_restarts_from_the_newest_good_checkpoint_and_a_damaged_one_is_set_aside(tmp_path):
    good = checkpoint(tmp_path, 2)
    damaged = checkpoint(tmp_path, 4)
    (damaged / "rng_state.pt").write_bytes(b"cut short")
    job, lines = Job(RolloutWorkerError("the rollout worker exited with code -9 without an error")), []
    assert restarting(job, tmp_path, 3, lines) == 1
    assert job.resumes == ["latest", str(good)]
    assert lines == ["restart 1/3 (RolloutWorkerError): the rollout worker exited with code -9 without an error; "
                     "resuming from step_000002 (step 2)"]  # fmt: skip
    assert not damaged.exists() and damaged.with_name("step_000004.damaged").is_dir()
    record = json.loads((tmp_path / "logs" / "restarts.jsonl").read_text())
    assert record == {"restart": 1, "time": 1234.0, "error": "RolloutWorkerError", "checkpoint": str(good),
                      "message": "the rollout worker exited with code -9 without an error"}  # fmt: skip
    assert restart_count(tmp_path) == 1


def test_a_hung_server_restarts_the_run_as_a_dead_one_does(tmp_path):
    """The health watchdog's failure (here: a probe that never answers, on an injected clock) is restartable."""
    checkpoint(tmp_path, 2)
    now = iter([0.0, 10.0])
    watchdog = HealthWatchdog(["http://a"], 10.0, lambda index: "the generation server at http://a",
                              clock=lambda: next(now), spawn=lambda probe: None)  # fmt: skip
    watchdog.check("during a weight sync")  # its probe goes out and never comes back
    with pytest.raises(ServerStartError) as hung:
        watchdog.check("during a weight sync")
    job, lines = Job(hung.value), []
    assert restarting(job, tmp_path, 1, lines) == 1
    assert lines[0].startswith("restart 1/1 (ServerStartError): the generation server at http://a stopped answering")
    assert lines[0].endswith("; resuming from step_000002 (step 2)")


def test_before_any_checkpoint_the_run_starts_again_and_its_metrics_move_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    job, lines = Job(TrainerRankError("trainer rank 1 exited with code -9")), []
    assert restarting(job, tmp_path, 1, lines) == 1
    assert job.resumes == ["latest", None]
    assert lines[0].endswith("resuming from the start (no checkpoint yet)")
    assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "logs" / "metrics.before_restart_1.jsonl").read_text() == '{"step": 1}\n'


def test_past_max_restarts_the_failure_ends_the_run(tmp_path):
    checkpoint(tmp_path, 2)
    second = TrainerRankError("trainer rank 1 exited with code -9")
    job, lines = Job(RolloutWorkerError("first"), second), []
    with pytest.raises(TrainerRankError) as raised:
        restarting(job, tmp_path, 1, lines)
    assert raised.value is second and len(job.resumes) == 2 and restart_count(tmp_path) == 1


@pytest.mark.parametrize("failure", [ConfigError("trainer.max_steps=x: not an int"), RolloutWorkerError("dead")])
def test_a_bad_config_or_a_run_without_restarts_stops_at_the_first_failure(tmp_path, failure):
    max_restarts = 0 if isinstance(failure, RolloutWorkerError) else 5
    job = Job(failure)
    with pytest.raises(type(failure)):
        restarting(job, tmp_path, max_restarts, [])
    assert job.resumes == ["latest"] and restart_count(tmp_path) == 0
