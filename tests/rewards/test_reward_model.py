"""``reward_model`` in reward_funcs: built from the config like a function, named as TRL names it, scored through the
trainer's endpoint beside the functions, weighed by reward_weights and logged unweighted."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.rewards.classifier import load_classifier
from asyncrl.rewards.endpoint import serving_reward_models
from asyncrl.rewards.reward_model import RewardModel, reward_model_options
from asyncrl.rollout.group_metrics import group_metrics
from asyncrl.rollout.scoring import RewardFunctionError, score_group
from asyncrl.rollout.types import RolloutGroup

ANSWERS = ["\\boxed{5}", "5", "the answer is \\boxed{5}"]

# What the rollout worker does with a reward model: unpickle it from its spec, await it on a group; prints the rewards
# and which of torch and transformers that imported.
SCORE_AS_THE_WORKER = """
import asyncio, json, pickle, sys
model = pickle.loads(sys.stdin.buffer.read())
prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
completions = [[{"role": "assistant", "content": "\\\\boxed{5}"}], [{"role": "assistant", "content": "4"}]]
rewards = asyncio.run(model(prompts, completions, [[1], [2]]))
print(json.dumps([rewards, sorted(m for m in ("torch", "transformers") if m in sys.modules)]))
"""
WORKER_COMPLETIONS = [[{"role": "assistant", "content": "\\boxed{5}"}], [{"role": "assistant", "content": "4"}]]


def make_group() -> RolloutGroup:
    n = len(ANSWERS)
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "What is 2 + 3?"}]] * n, reward_kwargs={"solution": ["5"] * n},
        completions=[[{"role": "assistant", "content": answer}] for answer in ANSWERS],
        completions_ids=[[1] * (i + 2) for i in range(n)], completions_sequences=[[] for _ in range(n)],
        tool_call_counts=[0] * n, tool_failure_counts=[0] * n, model_version=0, group_id=0, row_index=7,
        env_rewards=[None] * n, rollout_rewards=[None] * n,
    )  # fmt: skip


def mixed_plan(path: object):
    return plan_run(compose([f"reward_funcs=[{{name: reward_model, path: '{path}', batch_size: 2}}, {{name: length}}]",
                             "reward_weights=[2.0,0.5]"]))  # fmt: skip


def test_a_reward_model_mixes_with_a_function_under_reward_weights(tiny_classifier):
    path = tiny_classifier()
    plan = mixed_plan(path)
    sources = plan.components.rewards
    assert [(s.name, s.weight) for s in sources] == [(path.name, 2.0), ("length", 0.5)]  # TRL's name: the last part
    assert plan.components.advantage.reward_weights == {path.name: 2.0, "length": 0.5}
    group = make_group()
    with serving_reward_models(plan.config, sources):
        per_source = asyncio.run(score_group(group, sources))
    model = sources[0].fn
    classifier = load_classifier(model.options, "reward_funcs[0]", torch.device("cpu"), {})
    scores = np.array(classifier.score(group.prompts, group.completions))
    lengths = np.array([2.0, 3.0, 4.0])
    np.testing.assert_allclose(per_source[path.name], scores, rtol=1e-6)
    np.testing.assert_allclose(group.rewards, 2.0 * scores + 0.5 * lengths, rtol=1e-6)
    metrics = group_metrics(group, per_source, drop=None)
    np.testing.assert_allclose(metrics[f"rewards/{path.name}/mean"], scores, rtol=1e-6)  # unweighted
    assert metrics["rewards/length/mean"] == lengths.tolist()


def test_a_reward_model_not_served_fails_naming_it(tiny_classifier):
    sources = mixed_plan(tiny_classifier()).components.rewards
    with pytest.raises(RewardFunctionError, match=r"reward function 'tiny-rm-1' on row 7 raised RewardModelError: "
                                                  r"reward model .*tiny-rm-1 is not being served"):  # fmt: skip
        asyncio.run(score_group(make_group(), sources))


def test_reward_model_entries_are_read_typed_from_the_config(tiny_classifier):
    plan = mixed_plan(tiny_classifier())
    ((key, options),) = reward_model_options(plan.config)
    assert (key, options.path, options.batch_size, options.dtype) == ("reward_funcs[0]", str(tiny_classifier()), 2,
                                                                      "float32")  # fmt: skip
    assert isinstance(plan.components.rewards[0].fn, RewardModel)


def test_the_worker_scores_with_a_reward_model_without_torch(tiny_classifier):
    """The rollout worker has no GPU: the reward model it unpickles from its spec sends the group to the trainer's
    endpoint, importing neither torch nor transformers."""
    plan = mixed_plan(tiny_classifier())
    model = plan.components.rewards[0].fn
    with serving_reward_models(plan.config, plan.components.rewards):
        done = subprocess.run([sys.executable, "-c", SCORE_AS_THE_WORKER], input=pickle.dumps(model),
                              capture_output=True, timeout=120, check=True)  # fmt: skip
    rewards, imported = json.loads(done.stdout.decode().splitlines()[-1])
    assert imported == []
    classifier = load_classifier(model.options, "reward_funcs[0]", torch.device("cpu"), {})
    assert rewards == classifier.score([[{"role": "user", "content": "What is 2 + 3?"}]] * 2, WORKER_COMPLETIONS)
