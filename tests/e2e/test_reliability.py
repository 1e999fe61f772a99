"""Runs whose groups cannot train stop with one line saying why, after saving what they trained; a run whose groups
all score its top reward ends as a solved task; a group whose generation failed or whose prompt is too long is
dropped and counted while the run goes on (the out-of-memory run's steps before its failure: one run, each costs half
a minute of CI). The runs attach to the session's built-in server."""

from __future__ import annotations

import json

import pytest

from asyncrl.trainer.checkpoint import check_checkpoint, list_checkpoints

from .helpers import kill_marked, run_cli, wait_no_marked
from .test_train import attach, common_args, steps_of

pytestmark = pytest.mark.e2e


def turns_constant(value: float) -> list[str]:
    """The reward tests/e2e/rewards.py:turns_constant: 6 groups with spread (they train), then ``value`` for every
    rollout; a window of 8 such groups ends the run, past the steps those 6 filled."""
    return [f"reward_funcs=[{{name: tests.e2e.rewards:turns_constant, after: 6, value: {value}}}]",
            "rollout.max_consecutive_dropped_groups=8", "trainer.max_steps=50"]  # fmt: skip


def test_a_run_whose_groups_stop_carrying_signal_stops_saying_why_with_what_it_trained_saved(
    random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path
):  # fmt: skip
    """The reward turns constant at 0, below what the run scored before (not solved): every group has zero spread.
    The hang of issue 19 ends in seconds; since issue 53 the model and a checkpoint of the last step are saved first
    and the line says where."""
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), *turns_constant(0.0),
            *attach(session_server)]  # fmt: skip
    run = run_cli(args, timeout_s=180)
    leftover = wait_no_marked(run.marker)
    kill_marked(run.marker)
    assert run.returncode == 1, run.output[-3000:]
    step = steps_of(run_dir)[-1]["step"]
    checkpoints = list_checkpoints(run_dir)
    assert step >= 1 and checkpoints[-1].name == f"step_{step:06d}"
    check_checkpoint(checkpoints[-1])
    assert (run_dir / "model" / "model.safetensors").is_file()
    errors = [line for line in run.output.splitlines() if line.startswith("error (")]
    assert len(errors) == 1 and errors[0].startswith(
        "error (TrainingStalledError): no trainable group in the last 8 (rollout.max_consecutive_dropped_groups=8): "
        "zero_std 8 (rewards: turns_constant x8; last: turns_constant=0). zero_std: the rewards gave every rollout of "
        f"a prompt the same value; fix that, or raise the threshold (null: never stop); the model of step {step} is "
        f"saved in {run_dir / 'model'} (details: {run_dir / 'launch.log'}); resume from step_{step:06d} (step {step}) "
        "with: asyncrl train "
    )
    assert "Traceback" not in run.output
    assert leftover == []


def test_a_run_whose_groups_all_score_the_top_reward_ends_as_a_solved_task(
    random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path
):  # fmt: skip
    """The reward turns constant at 1, above every earlier score: the task is solved. The run says so in one line,
    evaluates, saves the model and a checkpoint, writes its report and exits 0."""
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), *turns_constant(1.0),
            "logging.report=true", *attach(session_server)]  # fmt: skip
    run = run_cli(args, timeout_s=180)
    leftover = wait_no_marked(run.marker)
    kill_marked(run.marker)
    assert run.returncode == 0, run.output[-3000:]
    solved = [line for line in run.output.splitlines() if "the task is solved" in line]
    assert solved == [
        "the task is solved for this model: 8 groups in a row scored 1 for every rollout (turns_constant=1), the "
        "highest reward of the run; training ends here (rollout.stop_when_solved=false: end as a stall)"
    ]
    step = steps_of(run_dir)[-1]["step"]
    assert step >= 1 and list_checkpoints(run_dir)[-1].name == f"step_{step:06d}"
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert json.loads((run_dir / "eval.json").read_text())["after_step"] == step
    assert (run_dir / "report" / "index.html").is_file()
    assert "error (" not in run.output and "Traceback" not in run.output
    assert leftover == []


def test_dropped_groups_are_counted_while_the_run_trains_until_out_of_memory_ends_it_in_one_line(
    random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path
):  # fmt: skip
    """Until then the run trains on while groups fail and long prompts are skipped, each counted: prompts render to
    17-19 tokens, data.max_prompt_length=18 skips most, and the loop fails one prompt in four. Then CUDA runs out of
    memory in a step's loss: the line names the keys that change the trainer's memory, the traceback is in the run's
    log, the checkpoint of the last step logged loads, and nothing is left."""
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "trainer.save_steps=1",
            "loss={name: tests.e2e.losses:OutOfMemoryAtFifthCall}", "data.max_prompt_length=18",
            "rollout.loop_cls=tests.e2e.loops:FailingForSomePrompts", "rollout.max_failed_group_fraction=0.5",
            *attach(session_server)]  # fmt: skip
    run = run_cli(args, timeout_s=180)
    leftover = wait_no_marked(run.marker)
    kill_marked(run.marker)
    assert run.returncode == 1, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error (")]
    assert len(errors) == 1 and errors[0].startswith("error (TrainerOutOfMemoryError): the trainer ran out of GPU")
    assert "packing.token_budget" in errors[0] and "server.gpu_memory_utilization" in errors[0]
    assert "Traceback" not in run.output
    assert "torch.OutOfMemoryError: CUDA out of memory" in (run_dir / "launch.log").read_text()
    steps = steps_of(run_dir)
    assert sum(s.get("rollout/skipped_long_prompt_count", 0) for s in steps) > 0
    assert sum(s.get("rollout/failed_group_count", 0) for s in steps) > 0
    assert all(s["loss"] == s["loss"] for s in steps)  # logged every step (TRL's `loss`)
    assert {"rollout/score_wait_s", "rollout/score_block_s", "rollout/score_queue_size"} <= set(steps[0])
    busy = [s["rollout/worker_cpu"] for s in steps if "rollout/worker_cpu" in s]
    assert busy and all(0 < share < 4 for share in busy), busy  # the worker's share of a core (its tool threads too)
    checkpoints = list_checkpoints(run_dir)
    assert checkpoints and checkpoints[-1].name == f"step_{steps[-1]['step']:06d}"
    for checkpoint in checkpoints:
        check_checkpoint(checkpoint)
    assert leftover == []
