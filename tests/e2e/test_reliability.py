"""Runs whose groups cannot train stop with one line saying why; a group whose generation failed or whose prompt
is too long is dropped and counted while the run goes on; a rollout worker killed mid-run is a restart
(trainer.max_restarts). The runs attach to the session's built-in server."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from .helpers import kill_marked, marked_pids, run_cli, start_cli, wait_no_marked
from .test_train import attach, common_args, steps_of

pytestmark = pytest.mark.e2e


def test_a_run_whose_every_group_is_dropped_stops_saying_why(
    random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path
):  # fmt: skip
    """A constant reward (length x 0): every group has zero spread. The hang of issue 19 now ends in seconds."""
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, tmp_path / "run"),
            "reward_funcs=[{name: length, scale: 0}]", "rollout.max_consecutive_dropped_groups=8",
            *attach(session_server)]  # fmt: skip
    run = run_cli(args, timeout_s=180)
    leftover = wait_no_marked(run.marker)
    kill_marked(run.marker)
    assert run.returncode == 1, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error (")]
    assert errors == [
        "error (TrainingStalledError): no trainable group in the last 8 (rollout.max_consecutive_dropped_groups=8): "
        "zero_std 8 (rewards: length x8; last: length=0). zero_std: the rewards gave every rollout of a prompt the "
        f"same value; fix that, or raise the threshold (null: never stop) (details: {tmp_path / 'run' / 'launch.log'})"
    ]
    assert "Traceback" not in run.output
    assert leftover == []


def test_failed_groups_and_long_prompts_are_dropped_and_counted_while_the_run_trains(
    random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path
):  # fmt: skip
    """Prompts render to 17-19 tokens: data.max_prompt_length=18 skips most; the loop fails one prompt in four."""
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "trainer.max_steps=1",
            "data.max_prompt_length=18", "rollout.loop_cls=tests.e2e.loops:FailingForSomePrompts",
            "rollout.max_failed_group_fraction=0.5", *attach(session_server)]  # fmt: skip
    run = run_cli(args, timeout_s=180)
    kill_marked(run.marker)
    assert run.returncode == 0, run.output[-3000:]
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == [1]
    assert sum(s.get("rollout/skipped_long_prompt_count", 0) for s in steps) > 0
    assert sum(s.get("rollout/failed_group_count", 0) for s in steps) > 0
    assert all(s["loss"] == s["loss"] for s in steps)  # logged every step (TRL's `loss`)
    assert {"rollout/score_wait_s", "rollout/score_block_s", "rollout/score_queue_size"} <= set(steps[0])


def test_a_worker_killed_mid_run_restarts_from_the_checkpoint_and_the_run_finishes(
    random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path
):  # fmt: skip
    """kill -9 of the rollout worker once the first checkpoint is written: one restart line, every step trained,
    no prompt trained twice (the prompts past the checkpoint's cursor that it had trained are skipped)."""
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "trainer.max_restarts=1",
            "trainer.max_steps=6", "trainer.save_steps=2", *attach(session_server)]  # fmt: skip
    proc, marker = start_cli(args)
    try:
        deadline = time.monotonic() + 150
        while not list((run_dir / "checkpoints").glob("step_*[0-9]")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        workers = [pid for pid in marked_pids(marker) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=150)
    finally:
        kill_marked(marker)
    assert proc.returncode == 0, output[-3000:]
    restarts = [line for line in output.splitlines() if line.startswith("restart ")]
    assert len(restarts) == 1 and restarts[0].startswith("restart 1/1 (RolloutWorkerError): "), output[-3000:]
    steps = steps_of(run_dir)
    assert sorted({s["step"] for s in steps}) == [1, 2, 3, 4, 5, 6] and steps[-1]["perf/restarts"] == 1
    last = run_dir / "checkpoints" / "step_000006"
    consumed = json.loads((last / "trainer_state.json").read_text())["prompts_consumed"]
    rollout = json.loads((last / "rollout_state.json").read_text())
    assert consumed == rollout["prompt_index"] + len(rollout["done_after_index"])  # each counted prompt is new
    assert wait_no_marked(marker) == []
