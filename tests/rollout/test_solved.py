"""Which groups are solved, and the retirement of prompts solved k times in a row (data.retire_solved_after)."""

from __future__ import annotations

import math

import numpy as np

from asyncrl.rollout.solved import RetireSolved, RewardRange, common_reward


def test_the_top_needs_a_lower_score_beside_it_and_nothing_above():
    rewards = RewardRange()
    rewards.see([1.0, 1.0, math.nan])
    assert not rewards.is_top(1.0)  # a constant reward so far: no evidence it is the best
    rewards.see([0.0])
    assert rewards.is_top(1.0) and not rewards.is_top(0.0) and not rewards.is_top(None)
    rewards.see([2.0])
    assert not rewards.is_top(1.0)


def test_common_reward_is_the_value_of_a_zero_spread_group_only():
    assert common_reward(np.array([1.0, 1.0, math.nan])) == 1.0
    assert common_reward(np.array([1.0, 0.0])) is None
    assert common_reward(np.array([1.0, math.nan, math.nan])) is None  # too few scored: not zero_std


def test_a_prompt_retires_after_k_solved_groups_in_a_row_and_an_unsolved_one_resets_its_streak():
    retire = RetireSolved(after=2)
    retire.on_group(row_index=0, rewards=np.array([0.0, 1.0]))  # the run's rewards have spread
    retire.on_group(7, np.array([1.0, 1.0]))
    assert not retire.retired(7)
    retire.on_group(7, np.array([0.0, 1.0]))  # learned again: the streak starts over
    retire.on_group(7, np.array([1.0, 1.0]))
    assert not retire.retired(7)
    retire.on_group(7, np.array([1.0, 1.0]))
    assert retire.retired(7) and not retire.retired(0)
    retire.on_group(3, np.array([0.0, 0.0]))  # all wrong: never retired (it may carry signal later)
    retire.on_group(3, np.array([0.0, 0.0]))
    assert not retire.retired(3)


def test_no_prompt_retires_without_the_option():
    retire = RetireSolved(after=None)
    retire.on_group(0, np.array([0.0, 1.0]))
    for _ in range(5):
        retire.on_group(7, np.array([1.0, 1.0]))
    assert not retire.retired(7)
