"""Runs whose groups cannot train stop with one line saying why; a group whose generation failed or whose prompt
is too long is dropped and counted while the run goes on. The runs attach to the session's built-in server."""

from __future__ import annotations

import pytest

from .helpers import kill_marked, run_cli, wait_no_marked
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
