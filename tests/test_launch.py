"""The launcher's checks before anything starts: a new run never trains into a directory that holds another, and
every server it launches has a free port."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.launch import (
    COMMAND_STARTED_ENV,
    TRITON_AUTOTUNE_CACHE_ENV,
    _check_resume,
    check_port,
    job_origin,
    keep_triton_autotuning,
    serve_overrides,
)
from asyncrl.serving.process import free_port, port_is_free
from asyncrl.trainer.checkpoint import ResumeError


def _config(run_dir: Path):  # type: ignore[no-untyped-def]
    return to_config(compose([f"trainer.output_dir={run_dir}"]))


@pytest.mark.parametrize("earlier", ["metrics.jsonl", "model/config.json", "checkpoints/step_000002/x"])
def test_a_new_run_refuses_a_directory_an_earlier_run_trained_in(tmp_path, earlier):
    (tmp_path / earlier).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / earlier).write_text("{}")
    with pytest.raises(ResumeError, match=r"trainer.resume_from_checkpoint=latest, or train into a new directory"):
        _check_resume(_config(tmp_path), tmp_path)


def test_a_directory_without_training_history_is_fine(tmp_path):
    (tmp_path / ".hydra").mkdir()  # Hydra writes these before the job: they are no history
    (tmp_path / "config.yaml").write_text("{}")  # a run that failed before its first step
    _check_resume(_config(tmp_path), tmp_path)


def test_each_replica_needs_its_port_free():
    port = free_port()
    while not port_is_free("127.0.0.1", port + 1):
        port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        check_port(to_config(compose([f"server.port={port}"])))  # one server: port + 1 is not its business
        with pytest.raises(ConfigError, match=rf"^server.port={port} \+ replica 1: 127.0.0.1:{port + 1} is already"):
            check_port(to_config(compose([f"server.port={port}", "server.replicas=2"])))


def _model_files(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_text("")
    return directory


def test_serve_takes_a_run_directory_with_its_overrides_then_the_given_ones(tmp_path):
    run = tmp_path / "run"
    checkpoint = _model_files(run / "checkpoints" / "step_000004")
    (run / ".hydra").mkdir()
    recorded = ["+recipe=deepmath", "hydra.run.dir=x", "trainer.resume_from_checkpoint=latest", "server.port=9"]
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in recorded))
    assert serve_overrides([str(run), "server.port=8001"]) == [
        "+recipe=deepmath", "server.port=9", "server.port=8001", f"model.name_or_path={checkpoint}"
    ]  # fmt: skip
    final = _model_files(run / "model")  # the final model comes before any checkpoint
    assert serve_overrides([str(run)])[-1] == f"model.name_or_path={final}"
    assert serve_overrides(["server.port=8001"]) == ["server.port=8001"]  # no directory: overrides only
    with pytest.raises(ConfigError, match=rf"^asyncrl serve {tmp_path}/nowhere: {tmp_path}/nowhere: no such dir"):
        serve_overrides([str(tmp_path / "nowhere")])


# ---- the job's failures, the job itself replaced by one that fails (it stands for the processes a run starts) ----


def test_a_restart_reads_the_plan_again_resuming_from_the_checkpoint_with_the_same_weights_dir(
    tmp_path, monkeypatch, capsys
):  # fmt: skip
    from test_restart import checkpoint

    from asyncrl import launch
    from asyncrl.plan_file import write_plan
    from asyncrl.trainer.assembler import RolloutWorkerError

    attempts, components = [], []
    planned = count_calls(monkeypatch, launch, "plan_run")

    def job(plan, run_dir, cfg):  # type: ignore[no-untyped-def]
        config = plan.config
        attempts.append((config.trainer.resume_from_checkpoint, config.server.weights_dir, config.trainer.max_steps))
        components.append(plan.components)
        write_plan(plan, run_dir)  # as run_job does before it starts a process
        if len(attempts) == 1:
            checkpoint(run_dir, 2)
            raise RolloutWorkerError("the rollout worker exited with code -9 without an error")

    monkeypatch.setattr(launch, "run_job", job)
    launch.run_hydra([f"hydra.run.dir={tmp_path}", "trainer.max_restarts=1", "trainer.max_steps=3"])
    claimed = attempts[0][1]  # the private weights directory the first attempt's plan chose (plan/assemble.py)
    assert Path(claimed).name.startswith("asyncrl-transfer-")
    assert attempts == [(None, claimed, 3), (str(tmp_path / "checkpoints" / "step_000002"), claimed, 3)]
    assert planned == [1] and components[0] is not components[1]  # the restart plans nothing; its components are new
    assert capsys.readouterr().err.splitlines() == [
        "restart 1/1 (RolloutWorkerError): the rollout worker exited with code -9 without an error; resuming from "
        "step_000002 (step 2)"
    ]


def test_a_full_disk_ends_in_one_line_with_the_command_that_starts_the_run_again(tmp_path, monkeypatch, capsys):
    import errno

    from asyncrl import launch

    def full(plan, run_dir, cfg):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl"))

    monkeypatch.setattr(launch, "run_job", full)
    with pytest.raises(SystemExit) as exited:
        launch.run_hydra([f"hydra.run.dir={tmp_path}", "trainer.max_steps=3"])
    assert exited.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error (OSError): No space left on device writing {tmp_path / 'metrics.jsonl'}: free space there; before "
        "its first checkpoint: nothing to resume; start again with: asyncrl train trainer.max_steps=3"
    ]


DIED = "the generation server at http://127.0.0.1:8000 (built-in, pid 7) was killed by SIGKILL; its log's last line: x"


@pytest.mark.parametrize("saved", [True, False], ids=["after-a-checkpoint", "before-any"])
def test_a_failure_after_a_checkpoint_ends_in_one_line_with_the_command_that_resumes_it(
    tmp_path, monkeypatch, capsys, saved
):  # fmt: skip
    """Whatever failed (a dead server here), a run with a checkpoint says how to go on from it, in the format
    Ctrl-C's line has; before its first checkpoint the error line is all (and launch.log gets the line too)."""
    from test_restart import checkpoint

    from asyncrl import launch
    from asyncrl.serving.process import ServerStartError

    def job(plan, run_dir, cfg):  # type: ignore[no-untyped-def]
        if saved:
            checkpoint(run_dir, 2)
        raise ServerStartError(DIED)

    monkeypatch.setattr(launch, "run_job", job)
    with pytest.raises(SystemExit) as exited:
        launch.run_hydra([f"hydra.run.dir={tmp_path}", "trainer.max_steps=3"])
    assert exited.value.code == 1
    error = f"error (ServerStartError): {DIED} (details: {tmp_path / 'launch.log'})"
    resume = (
        f"; resume from step_000002 (step 2) with: asyncrl train trainer.max_steps=3 "
        f"trainer.resume_from_checkpoint=latest hydra.run.dir={tmp_path}"
    )
    assert capsys.readouterr().err.splitlines() == [error + resume if saved else error]
    assert (resume if saved else DIED) in (tmp_path / "launch.log").read_text()


def test_a_transfer_directory_left_by_a_launcher_killed_outright_goes_with_the_next_launch(tmp_path):
    """kill -9 of the CLI runs no exit handler: its /dev/shm directory (named by its pid) stays until the next
    launch, which removes it; a live launcher's, and one named otherwise, stay."""
    import subprocess
    import sys

    from asyncrl.launch import remove_orphaned_transfer_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"asyncrl-transfer-{int(dead.stdout)}-x1"
    live = tmp_path / "asyncrl-transfer-1-x2"  # init: always alive
    other = tmp_path / "asyncrl-transfer-abcdef"
    for path in (orphan, live, other):
        (path / "asyncrl-weights").mkdir(parents=True)
    remove_orphaned_transfer_dirs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, other.name]


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """``module.name`` wrapped to count its calls: a one-item list, the count so far."""
    calls = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_restart_keeps_the_gpus_the_first_attempt_placed_its_servers_on(tmp_path, monkeypatch):
    """The launcher narrows its CUDA_VISIBLE_DEVICES to the trainer's GPUs when it starts vLLM: a restart reads the
    placement from plan.json rather than placing the servers again on what is left visible."""
    from asyncrl.launch import resumed_plan
    from asyncrl.plan.assemble import plan_run
    from asyncrl.plan_file import write_plan
    from asyncrl.run_plan import GpuSplit

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    plan = plan_run(compose(["server=vllm", "server.max_model_len=512", "server.vllm_version=0.33.0"]), tmp_path)
    write_plan(plan, tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # as launch.start_server leaves it
    again = resumed_plan(tmp_path, str(tmp_path / "checkpoints" / "step_000002"))
    assert again.gpu_split == plan.gpu_split == GpuSplit(["0"], ["1"]) and again.weight_transfer == "nccl"
    assert again.config.trainer.resume_from_checkpoint == str(tmp_path / "checkpoints" / "step_000002")
    assert again.server_commands == plan.server_commands  # launched as the first attempt launched them
    assert plan.server_commands[0].env["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    ("need", "held", "share"),
    # the trainer needs 30 + 1 GiB + a margin of 0.3 x 31 GiB = 40.3 GiB of 80, vLLM's context 1 GiB: vLLM gets the
    # rest, 0.48; a room held before the warm-up (trainer/memory.py::held_room) leaves it 0.3
    [(40.3, False, "0.48"), (55.0, True, "0.3")],
)
def test_a_vllm_waiting_for_the_warm_up_writes_the_measured_stage_once_and_a_restart_launches_it_as_written(
    tmp_path, monkeypatch, need, held, share
):
    """vLLM on the trainer's only GPU: the plan written before anything starts has no command for it; its launch on
    the warm-up's figure (or the room the trainer held for it) adds the measured stage (that figure, and the command
    whose share it gives) to plan.json. A restart reads both and launches the command as written, whatever its own
    warm-up knows."""
    import asyncrl.launch as launch
    from asyncrl.footprint import GIB, TrainerMemory
    from asyncrl.plan.assemble import plan_run
    from asyncrl.plan_file import read_plan, write_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path / "cache"))  # no earlier run's figure
    launched: list[object] = []
    monkeypatch.setattr(launch, "launched_server", lambda plan, run_dir, replica: launched.append(plan))
    plan = plan_run(compose(["server=vllm", "server.max_model_len=512", "server.vllm_version=0.33.0"]), tmp_path)
    assert plan.gpu_split is not None and plan.gpu_split.shared
    write_plan(plan, tmp_path)
    assert read_plan(tmp_path).server_commands is None and read_plan(tmp_path).trainer_memory is None
    memory = (
        TrainerMemory.with_need(int(55 * GIB), 7 * GIB, 80 * GIB) if held else TrainerMemory(30 * GIB, GIB, 80 * GIB)
    )
    assert round(memory.need_bytes / GIB, 1) == need
    launch.after_warm_up(plan, tmp_path)(0, memory)
    staged = read_plan(tmp_path)
    assert launched == [staged] and staged.trainer_memory == memory and staged.server_commands is not None
    assert staged.trainer_memory.held is held  # a restart holds the same room again (trainer/loop.py)
    argv = staged.server_commands[0].argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == share
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".plan")] == []  # written whole, then renamed
    again = launch.resumed_plan(tmp_path, None)
    launch.after_warm_up(again, tmp_path)(0, TrainerMemory(50 * GIB, GIB, 80 * GIB))
    assert launched[-1] is again and read_plan(tmp_path) == staged  # nothing derived again, nothing rewritten


def test_the_continue_line_resumes_a_whole_checkpoint_and_starts_anew_from_a_model_only_one(tmp_path):
    """An interrupted or failed run says how to go on: resume from its newest checkpoint, or, where that holds the
    model only (trainer.save_only_model), a new run from its weights, since a resume would be refused."""
    from asyncrl.launch import continue_line

    kept, run_dir = ["trainer.max_steps=9"], tmp_path / "run"
    assert continue_line(kept, run_dir, tmp_path) == (
        "before its first checkpoint: nothing to resume; start again with: asyncrl train trainer.max_steps=9"
    )
    for step, model_only in ((2, False), (4, True)):
        checkpoint = tmp_path / "checkpoints" / f"step_{step:06d}"
        checkpoint.mkdir(parents=True)
        state = {"step": step, "model_version": step, "prompts_consumed": 0, "model_only": model_only}
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        line = continue_line(kept, run_dir, tmp_path)
        if model_only:
            assert line == ("step_000004 (step 4) holds the model only (trainer.save_only_model), which cannot "
                            "resume; go on in a new run from its weights: asyncrl train trainer.max_steps=9 "
                            f"model.name_or_path={checkpoint}")  # fmt: skip
        else:
            assert line == ("resume from step_000002 (step 2) with: asyncrl train trainer.max_steps=9 "
                            f"trainer.resume_from_checkpoint=latest hydra.run.dir={run_dir}")  # fmt: skip


def test_the_first_job_counts_from_the_command_and_a_sweeps_later_jobs_from_their_own_start(monkeypatch):
    monkeypatch.setenv(COMMAND_STARTED_ENV, "100.0")
    assert job_origin(now=114.0) == 100.0  # the imports and checks before the job are part of its start-up
    assert job_origin(now=500.0) == 500.0  # the second job of the sweep did not wait for the first's


def test_triton_keeps_its_autotuning_unless_the_user_said_otherwise(monkeypatch):
    monkeypatch.delenv(TRITON_AUTOTUNE_CACHE_ENV, raising=False)
    keep_triton_autotuning()
    assert os.environ[TRITON_AUTOTUNE_CACHE_ENV] == "1"
    monkeypatch.setenv(TRITON_AUTOTUNE_CACHE_ENV, "0")
    keep_triton_autotuning()
    assert os.environ[TRITON_AUTOTUNE_CACHE_ENV] == "0"
