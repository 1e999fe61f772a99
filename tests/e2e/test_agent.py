"""The agent recipe through the real CLI: tiny-counter calls IncrementEnv's tool, the env reward trains it, and a
reward function reads each completion's environment instance (TRL's ``environments`` argument).

A few steps only: the rise in success is measured by the recipe's full run (asyncrl/assets/README.md); this
checks the plumbing (calls made and parsed, env reward and timings logged, checkpoint, no process left).
"""

from __future__ import annotations

import math

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import free_port

from .helpers import run_cli, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 2


def test_counter_agent_recipe_calls_tools_and_trains_on_the_env_reward(tmp_path):
    run_dir = tmp_path / "run"
    run = run_cli(["train", "+recipe=counter_agent", f"trainer.max_steps={STEPS}", f"trainer.save_steps={STEPS}",
                   "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}",
                   f"server.port={free_port()}", "reward_funcs=[{name: 'tests.e2e.rewards:episode_state'}]"],
                  timeout_s=300)  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))

    def logged(key: str) -> list[float]:
        return [s[key] for s in steps if s.get(key) is not None and not math.isnan(s[key])]

    assert sum(logged("tools/increment/call_count")) > 0  # the model called the tool and the call parsed
    assert max(logged("tools/call_frequency")) > 0
    assert logged("tools/failure_frequency") and min(logged("tools/failure_frequency")) < 1
    rewards = logged("rewards/IncrementEnv/mean")
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards)
    assert logged("env/reset_s") and logged("env/reward_s")
    assert logged("episode/counter_mean")  # the reward function got the instances, each still on its own episode
    assert max(logged("rollout/turns_max")) >= 2  # a tool result went back to the model for another turn
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors").is_file()
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert wait_no_marked(run.marker) == []
