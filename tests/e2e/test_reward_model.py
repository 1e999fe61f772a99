"""A reward model in reward_funcs, end to end on CPU: the real CLI trains the random tiny model for two steps with a
tiny random sequence classifier beside the ``length`` function, weighed by reward_weights; the classifier is served
by the trainer (its endpoint's log line) and scores the groups and the held-out prompts."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import free_port

from .helpers import run_cli, wait_no_marked

pytestmark = pytest.mark.e2e

WEIGHTS = (2.0, 0.1)


@pytest.fixture(scope="module")
def reward_model_run(random_tiny_model_dir, arithmetic_data_dir, tiny_classifier, fresh_server, tmp_path_factory):
    server, classifier = fresh_server(), tiny_classifier()
    run_dir = tmp_path_factory.mktemp("reward-model") / "run"
    data = arithmetic_data_dir
    rewards = f"reward_funcs=[{{name: reward_model, path: '{classifier}', batch_size: 4}}, {{name: length}}]"
    args = ["train", f"model.name_or_path={random_tiny_model_dir}", f"data.path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'eval.jsonl'}", "data.num_eval_prompts=2", rewards,
            f"reward_weights=[{WEIGHTS[0]},{WEIGHTS[1]}]", "packing.token_budget=512", "trainer.max_steps=2",
            "trainer.save_strategy=no", "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}",
            f"server.port={free_port()}", "server.launch=false", f"server.base_url={server.base_url}",
            "trainer.cpu_threads=1"]  # fmt: skip
    return run_cli(args), run_dir, classifier.name


def test_the_reward_model_scores_every_group_beside_the_function(reward_model_run):
    run, run_dir, name = reward_model_run
    assert run.returncode == 0, run.output[-3000:]
    assert "reward models served on cpu from http://127.0.0.1:" in (run_dir / "launch.log").read_text()
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(f"rewards/{name}/group_std" in s for s in steps)  # each trained sample's group was scored by it
    scored = [s for s in steps if "reward" in s]  # a step whose window scored groups (step 2 may train earlier ones)
    assert scored
    for s in scored:  # every rollout scored by both: the reward is their weighted sum, each logged unweighted
        expected = WEIGHTS[0] * s[f"rewards/{name}/mean"] + WEIGHTS[1] * s["rewards/length/mean"]
        assert math.isclose(s["reward"], expected, rel_tol=1e-6), s
        assert all(s[key] >= 0 for key in ("reward_std", f"rewards/{name}/std", "rewards/length/std")), s  # TRL's
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert math.isfinite(evaluation["after"]["eval/sampled_reward"])
    assert wait_no_marked(run.marker) == []
