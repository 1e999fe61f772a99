"""The reward models' scoring endpoint: on loopback, behind its own token, serving the run's reward models while the
block runs and telling each ``RewardModel`` where it is."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from asyncrl.app_thread import serve_in_thread
from asyncrl.config import ConfigError
from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.rewards.classifier import load_classifier
from asyncrl.rewards.endpoint import build_app, serving_reward_models
from asyncrl.rewards.reward_model import RewardModelOptions

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
COMPLETIONS = [[{"role": "assistant", "content": "\\boxed{5}"}], [{"role": "assistant", "content": "4"}]]


def test_only_requests_with_the_token_are_scored(tiny_classifier):
    classifier = load_classifier(RewardModelOptions(path=str(tiny_classifier())), "reward_funcs[0]",
                                 torch.device("cpu"), {})  # fmt: skip
    body = {"prompts": PROMPTS, "completions": COMPLETIONS}
    with serve_in_thread(build_app([classifier], "s3cret")) as base_url:
        assert base_url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{base_url}/health").status_code == 200
        assert httpx.post(f"{base_url}/score/0", json=body).status_code == 401
        wrong = httpx.post(f"{base_url}/score/0", json=body, headers={"Authorization": "Bearer guess"})
        assert wrong.status_code == 401
        token = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{base_url}/score/1", json=body, headers=token).status_code == 404
        uneven = httpx.post(f"{base_url}/score/0", json={**body, "prompts": PROMPTS[:1]}, headers=token)
        assert uneven.status_code == 400
        scored = httpx.post(f"{base_url}/score/0", json=body, headers=token)
        assert scored.status_code == 200 and scored.json()["rewards"] == classifier.score(PROMPTS, COMPLETIONS)


def test_the_run_serves_its_reward_models_for_the_block_only(tiny_classifier):
    path = tiny_classifier()
    plan = plan_run(compose([f"reward_funcs=[{{name: length}}, {{name: reward_model, path: '{path}'}}]"]))
    sources = plan.components.rewards
    model = sources[1].fn
    with serving_reward_models(plan.config, sources):
        assert model.endpoint is not None and model.endpoint.url.endswith("/score/0")
        assert model.endpoint.timeout_s == plan.config.server.timeout
        scores = asyncio.run(model(PROMPTS, COMPLETIONS, [[1], [2]]))
        with httpx.Client() as client:  # not without the run's token
            assert client.post(model.endpoint.url, json={"prompts": [], "completions": []}).status_code == 401
    assert model.endpoint is None
    expected = load_classifier(model.options, "reward_funcs[1]", torch.device("cpu"), {}).score(PROMPTS, COMPLETIONS)
    assert scores == expected


def test_the_served_reward_models_load_with_model_trust_remote_code(custom_code_classifier):
    """A reward model with its own code is served only when model.trust_remote_code allows it."""
    entry = f"reward_funcs=[{{name: reward_model, path: '{custom_code_classifier}'}}]"
    plan = plan_run(compose([entry]))
    with pytest.raises(ConfigError, match=r"set model\.trust_remote_code=true to run it"):
        with serving_reward_models(plan.config, plan.components.rewards):
            pass
    plan = plan_run(compose([entry, "model.trust_remote_code=true"]))
    with serving_reward_models(plan.config, plan.components.rewards):
        assert len(asyncio.run(plan.components.rewards[0].fn(PROMPTS, COMPLETIONS, [[1], [2]]))) == 2
