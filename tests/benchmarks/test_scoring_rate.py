"""benchmarks/scoring_rate.py: its groups score as a model near convergence answers, and the rate is counted."""

from __future__ import annotations

import asyncio
import random
from types import ModuleType

import numpy as np

from asyncrl.rewards.accuracy import Accuracy, AccuracyOptions
from asyncrl.rewards.format import Format
from asyncrl.rollout.scoring import RewardSource, score_group


def test_an_arithmetic_group_scores_its_right_answers_two_and_the_others_one(scoring_rate: ModuleType) -> None:
    group = scoring_rate.arithmetic_group(12, 30, random.Random(1), size=16)
    sources = [RewardSource("accuracy", Accuracy(AccuracyOptions())), RewardSource("format", Format())]
    asyncio.run(score_group(group, sources))
    right = np.array(["{42}" in c[0]["content"] for c in group.completions])
    assert right.any() and not right.all()
    assert np.array_equal(group.rewards, np.where(right, 2.0, 1.0))


def test_the_rate_counts_groups_scored_with_the_loop_busy(scoring_rate: ModuleType) -> None:
    for concurrency in (1, 2):
        assert asyncio.run(scoring_rate.groups_per_s(0.5, prompts=4, seconds=0.3, seed=0, concurrency=concurrency)) > 0
