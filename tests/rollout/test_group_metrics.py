"""Metrics of scored groups: TRL's reward_std and rewards/<fn>/std are the spread across the window's completions,
not the mean of per-group spreads (the async spec's reward_group_std)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from asyncrl.metrics import MetricWindow
from asyncrl.rollout.group_metrics import group_metrics
from asyncrl.rollout.types import RolloutGroup


def scored_group(rewards: list[float], accuracy: list[float]) -> RolloutGroup:
    """A scored group of len(rewards) single-turn completions; ``accuracy`` is one source (NaN: not applicable)."""
    n = len(rewards)
    return RolloutGroup(
        prompts=["q"] * n, reward_kwargs={}, completions=["a"] * n, completions_ids=[[i] for i in range(n)],
        completions_sequences=[[] for _ in range(n)], tool_call_counts=[0] * n, tool_failure_counts=[0] * n,
        model_version=0, group_id=0, row_index=0, env_rewards=[None] * n, rollout_rewards=[None] * n,
        rewards=np.array(rewards), reward_components={"accuracy": np.array(accuracy)},
    )  # fmt: skip


def test_reward_std_is_the_spread_across_the_window_completions_not_a_mean_of_group_spreads():
    window = MetricWindow()
    # two groups with no spread of their own (both dropped as zero-std groups), apart from each other
    for rewards, accuracy in (([0.0, 0.0], [0.0, math.nan]), ([1.0, 1.0], [1.0, 1.0])):
        group = scored_group(rewards, accuracy)
        window.extend(group_metrics(group, group.reward_components, "zero_std"))
    window.extend({"reward_group_std": [0.0, 0.0, 0.0, 0.0], "rewards/accuracy/group_std": [0.0, 0.0]})
    metrics = window.reduce()
    assert metrics["reward"] == 0.5
    assert metrics["reward_std"] == pytest.approx(statistics.stdev([0.0, 0.0, 1.0, 1.0]))  # 0.577, Bessel's, as TRL
    assert metrics["rewards/accuracy/std"] == pytest.approx(statistics.stdev([0.0, 1.0, 1.0]))  # NaN skipped
    assert metrics["frac_reward_zero_std"] == 1.0  # means, whatever their last word
    assert metrics["reward_group_std"] == 0.0 and metrics["rewards/accuracy/group_std"] == 0.0


def test_reward_std_of_a_single_completion_is_nan():
    group = scored_group([1.0], [1.0])
    window = MetricWindow()
    window.extend(group_metrics(group, group.reward_components, None))
    assert math.isnan(window.reduce()["reward_std"])
