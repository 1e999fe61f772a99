"""The embedded default, shortened: the shipped tiny model really learns arithmetic on CPU.

The full default (`asyncrl train`) runs 60 steps; this runs 16 and asks for a smaller, robust gain in the
worker's `reward` (all scored groups) plus the held-out evaluation before/after. The same run checks the
default's asynchrony: every step trains, no sample is staler than the default bound (4), generation and
training overlap, and the launched server and worker are gone afterwards.
"""

from __future__ import annotations

import json

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import free_port

from .helpers import run_cli, wait_no_marked

pytestmark = [pytest.mark.e2e, pytest.mark.long]

STEPS = 20  # last 5 steps' mean reward over the first 5's: 0.074-0.092 at 16 steps (7 runs), 0.10 at 20, 0.13 at 24


def test_shortened_default_raises_the_reward_asynchronously(tmp_path):
    run_dir = tmp_path / "run"
    run = run_cli(["train", f"trainer.max_steps={STEPS}", "trainer.save_strategy=no", "data.num_eval_prompts=100",
                   "logging.console=plain", f"hydra.run.dir={run_dir}", f"server.port={free_port()}"],
                  timeout_s=900)  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    rewards = [m["reward"] for m in steps if m.get("reward") is not None]
    first, last = rewards[:5], rewards[-5:]
    assert sum(last) / len(last) - sum(first) / len(first) >= 0.05, rewards
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["after"]["eval/sampled_reward"] > evaluation["before"]["eval/sampled_reward"]
    assert evaluation["after"]["eval/greedy_reward"] >= evaluation["before"]["eval/greedy_reward"] - 0.05  # no
    # unlearning of what the model already got right greedily (it answers every eval prompt right greedily)
    assert (run_dir / "report" / "index.html").is_file()
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["batch/trained_tokens_per_step"] > 0 for s in steps)
    assert max(s["sample/staleness_max"] for s in steps) <= 4
    assert json.loads((run_dir / "timeline.json").read_text())["summary"]["overlap_frac"] > 0.0
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert wait_no_marked(run.marker) == []
