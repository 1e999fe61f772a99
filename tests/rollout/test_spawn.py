"""Everything the worker receives must pickle; failures name the object and the fix, before spawning."""

from __future__ import annotations

import functools

import pytest

from asyncrl.rewards.length import length
from asyncrl.rollout.spawn import UnpicklableError, check_picklable


class ScaledReward:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, prompts, completions, completion_ids, **kw):
        return [self.scale * len(c) for c in completion_ids]


def test_module_level_partial_and_instances_pickle():
    check_picklable(length, "reward function 'length'")
    check_picklable(functools.partial(length, scale=2.0), "reward function 'length'")
    check_picklable(ScaledReward(0.5), "reward function 'ScaledReward'")


def test_lambda_fails_naming_it_and_the_fix():
    expected = (r"reward function 'my_lambda' cannot be sent to the rollout worker(.|\n)*"
                r"module-level function, functools.partial")  # fmt: skip
    with pytest.raises(UnpicklableError, match=expected):
        check_picklable(lambda **kw: [1.0], "reward function 'my_lambda'")


def test_closure_fails():
    def make():
        offset = 1.0

        def reward(completion_ids, **kw):
            return [offset for _ in completion_ids]

        return reward

    with pytest.raises(TypeError, match="closure"):
        check_picklable(make(), "reward function 'reward'")
