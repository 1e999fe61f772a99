"""Group z-score advantages, NaN (unscorable) handling and the drop rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.advantages import ADVANTAGES, group_drop_reason, group_zscore

nan = math.nan


def test_known_values_use_population_std():
    # rewards 0, 1, 2: mean 1, population std sqrt(2/3) = 0.81650 (Bessel's would give 1.0)
    advantages = group_zscore(np.array([0.0, 1.0, 2.0]))
    np.testing.assert_allclose(advantages, [-1.2247448, 0.0, 1.2247448], rtol=1e-6)


def test_binary_rewards():
    # mean 0.25, std sqrt(0.25 * 0.75) = 0.4330127
    advantages = group_zscore(np.array([1.0, 0.0, 0.0, 0.0]))
    np.testing.assert_allclose(advantages, [1.7320508, -0.5773503, -0.5773503, -0.5773503], rtol=1e-6)


def test_unscorable_rollouts_get_zero_and_are_left_out_of_mean_and_std():
    # scorable rewards 3 and 1: mean 2, std 1
    advantages = group_zscore(np.array([3.0, nan, 1.0, nan]))
    np.testing.assert_allclose(advantages, [1.0, 0.0, -1.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("rewards", [[nan, nan], [2.0, nan], [0.5, 0.5, 0.5], []])
def test_degenerate_groups_give_zero_advantages(rewards):
    advantages = group_zscore(np.array(rewards))
    assert advantages.shape == (len(rewards),) and not advantages.any()


@pytest.mark.parametrize(
    ("rewards", "reason"),
    [
        ([1.0, 1.0, 1.0], "zero_std"),
        ([0.0, nan, 0.0], "zero_std"),
        ([1.0, nan, nan], "too_few_scorable"),
        ([nan, nan], "too_few_scorable"),
        ([], "too_few_scorable"),
        ([0.0, 1.0], None),
        ([nan, 0.0, 1e-9], None),
    ],
)
def test_group_drop_reason(rewards, reason):
    assert group_drop_reason(np.array(rewards)) == reason


def test_rejects_infinite_rewards_and_wrong_shapes():
    with pytest.raises(ValueError, match="finite"):
        group_zscore(np.array([1.0, math.inf]))
    with pytest.raises(ValueError, match="1-D"):
        group_drop_reason(np.zeros((2, 2)))


def test_registry_builds_the_default():
    assert "group_zscore" in ADVANTAGES
    np.testing.assert_allclose(ADVANTAGES.build({"name": "group_zscore"})(np.array([0.0, 2.0])), [-1.0, 1.0], rtol=1e-6)


@given(st.lists(st.one_of(st.floats(-100, 100), st.just(nan)), min_size=2, max_size=16))
def test_zscore_has_zero_mean_and_unit_std_over_scorable(values):
    rewards = np.array(values)
    advantages = group_zscore(rewards)
    kept = ~np.isnan(rewards)
    assert np.all(advantages[~kept] == 0.0)
    # above a spread of 1e-2 the 1e-8 in the denominator moves the std by less than 1e-6
    if group_drop_reason(rewards) is None and rewards[kept].std() > 1e-2:
        assert abs(advantages[kept].mean()) < 1e-9
        assert advantages[kept].std() == pytest.approx(1.0, rel=1e-5)
