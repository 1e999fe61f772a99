"""The embedded default, shortened: the shipped tiny model really learns arithmetic on CPU.

The full default (`asyncrl train`) runs 60 steps; this runs 24 and asks for a smaller, robust gain in the
worker's `reward` (all scored groups) plus the held-out evaluation before/after.
"""

from __future__ import annotations

import json

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.server.process import free_port

from .helpers import run_cli, wait_no_marked

pytestmark = pytest.mark.e2e


def test_shortened_default_raises_the_reward(tmp_path):
    run_dir = tmp_path / "run"
    run = run_cli(["train", "trainer.max_steps=24", "trainer.save_strategy=no", "data.num_eval_prompts=100",
                   "logging.console=plain", f"hydra.run.dir={run_dir}", f"server.port={free_port()}"],
                  timeout_s=900)  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    rewards = [m["reward"] for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("reward") is not None]
    first, last = rewards[:5], rewards[-5:]
    assert sum(last) / len(last) - sum(first) / len(first) >= 0.05, rewards
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["after"]["eval/sampled_reward"] > evaluation["before"]["eval/sampled_reward"]
    assert (run_dir / "report" / "index.html").is_file()
    assert wait_no_marked(run.marker) == []
