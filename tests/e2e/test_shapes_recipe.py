"""The shapes recipe through the real CLI: the shipped tiny-vlm counts the squares in the shipped images, which reach
the built-in server and the trainer's rows; the accuracy reward scores the counts, held out before and after.

Two steps only: the rise in held-out reward is measured by the recipe's full run (asyncrl/assets/README.md); this
checks the plumbing (steps logged with their images, evaluation, checkpoint, no process left).
"""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import free_port

from .helpers import run_cli, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 2


def test_shapes_recipe_trains_the_tiny_vlm_on_its_images(tmp_path):
    """Also: the reward functions see each prompt's image (tests/e2e/rewards.py::image_reward) and the completions
    table shows where it stood (logging.log_multimodal)."""
    run_dir = tmp_path / "run"
    rewards = "reward_funcs=[{name: accuracy}, {name: 'tests.e2e.rewards:image_reward'}]"
    run = run_cli(["train", "+recipe=shapes", f"trainer.max_steps={STEPS}", f"trainer.save_steps={STEPS}",
                   "data.num_eval_prompts=4", "trainer.samples_per_step=16", "logging.console=plain",
                   "logging.report=false", rewards,
                   "logging.log_completions=true", "logging.num_completions_to_print=2",
                   f"hydra.run.dir={run_dir}", f"server.port={free_port()}"], timeout_s=300)  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps if "batch/samples_per_step" in s] == list(range(1, STEPS + 1))

    def logged(key: str) -> list[float]:
        return [s[key] for s in steps if s.get(key) is not None and not math.isnan(s[key])]

    assert logged("batch/images_per_step") and min(logged("batch/images_per_step")) >= 1
    assert logged("rewards/accuracy/mean") and all(0.0 <= r <= 1.0 for r in logged("rewards/accuracy/mean"))
    assert logged("rewards/image_reward/mean") and min(logged("rewards/image_reward/mean")) == 1.0
    assert "<image>How many squares?" in run.output and "1 image" in run.output  # the completions table
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert {"eval/greedy_reward", "eval/sampled_reward"} <= set(evaluation["before"]) & set(evaluation["after"])
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert wait_no_marked(run.marker) == []
