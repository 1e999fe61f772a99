"""Advantage estimators (group z-score, Dr. GRPO, RLOO, LitePPO, GDPO), NaN (unscorable) handling, the drop
rule, and how the rollout loop calls them."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.advantages import (
    ADVANTAGES,
    StepRule,
    estimate_advantages,
    gdpo,
    group_drop_reason,
    group_mean,
    group_zscore,
    rloo,
    silent_rewards,
    step_affine,
)
from asyncrl.rollout.loop import AsyncRolloutLoop
from asyncrl.rollout.scoring import RewardSource, score_group

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
    np.testing.assert_allclose(
        ADVANTAGES.build({"name": "group_zscore"})(np.array([0.0, 2.0]), {}), [-1.0, 1.0], rtol=1e-6
    )


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


# ---- the other estimators ------------------------------------------------------------------------------------


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-10)


def test_group_mean_has_no_std_scaling():
    # scorable 3, 1, 2: mean 2
    close(ADVANTAGES.build("group_mean")(np.array([3.0, nan, 1.0, 2.0]), {}), [1.0, 0.0, -1.0, 0.0])


def rloo_reference(rewards):
    out = []
    for i, r in enumerate(rewards):
        others = [x for j, x in enumerate(rewards) if j != i and not math.isnan(x)]
        out.append(0.0 if math.isnan(r) or not others else r - sum(others) / len(others))
    return out


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 1.0], [0.3, nan, -2.0, 5.0, 1.25], [2.0, nan], [nan, nan]])
def test_rloo_matches_the_leave_one_out_baseline(rewards):
    close(rloo(np.array(rewards)), rloo_reference(rewards))


@given(st.lists(st.one_of(st.floats(-100, 100), st.just(nan)), min_size=2, max_size=16))
def test_rloo_is_a_rescaled_group_mean_and_sums_to_zero(values):
    rewards = np.array(values)
    kept = ~np.isnan(rewards)
    if kept.sum() >= 2:
        n = kept.sum()
        np.testing.assert_allclose(rloo(rewards), n / (n - 1) * group_mean(rewards), rtol=1e-12, atol=1e-9)
        assert abs(rloo(rewards).sum()) < 1e-9 * max(1.0, np.abs(rewards[kept]).max())


def test_lite_ppo_leaves_the_std_to_the_step():
    estimator = ADVANTAGES.build("group_mean_batch_std")
    close(estimator(np.array([1.0, 3.0, nan]), {}), [-1.0, 1.0, 0.0])
    assert estimator.step_rule is StepRule.reward_std and ADVANTAGES.build("group_zscore").step_rule is None
    # rewards 3 and 1 of the step's scorable rollouts: std 1
    shift, scale = step_affine("reward_std", np.array([3.0, 1.0, nan]), np.array([1.0, -1.0, 0.0]))
    assert shift == 0.0 and scale == pytest.approx(1.0 + 1e-8, abs=1e-15)


def zscore_reference(values):
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return [0.0] * len(values)
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))
    return [0.0 if math.isnan(v) else (v - mean) / (std + 1e-8) for v in values]


def test_gdpo_sums_each_functions_group_zscore():
    components = {
        "accuracy": np.array([1.0, 0.0, 0.0, 1.0, nan]),
        "format": np.array([1.0, 1.0, 0.0, nan, nan]),  # not applicable to the last two
        "length": np.array([0.2, 0.9, 0.4, 0.1, nan]),
    }
    rewards = np.array([2.2, 1.9, 0.4, 1.1, nan])  # the sums; the last rollout is unscorable
    expected = np.sum([zscore_reference(list(v)) for v in components.values()], axis=0)
    close(gdpo(rewards, components=components), expected)
    assert gdpo(rewards, components=components)[-1] == 0.0
    assert ADVANTAGES.build({"name": "gdpo"}).step_rule is StepRule.zscore
    shift, scale = step_affine("zscore", np.array([1.0, 2.0, nan]), np.array([3.0, 1.0, 0.0]))
    assert (shift, scale) == pytest.approx((2.0, 1.0 + 1e-8))


def test_gdpo_keeps_reward_combinations_apart_that_the_sum_merges():
    # rollouts 0, 1 and 2 all sum to 1, but only rollout 0 is accurate (accuracy is the rarer success)
    components = {"accuracy": np.array([1.0, 0.0, 0.0, 0.0]), "format": np.array([0.0, 1.0, 1.0, 0.0])}
    rewards = components["accuracy"] + components["format"]
    assert group_zscore(rewards)[0] == group_zscore(rewards)[1]
    advantages = gdpo(rewards, components=components)
    assert advantages[0] > advantages[1]


def test_gdpo_gives_exactly_zero_for_a_function_whose_scorable_values_are_equal():
    """Every group of the step: constant per function, a None in one, so the sums vary and each group trains. The
    functions' rounding noise (1e-9 after the division by std + 1e-8) must not become the step's z-scored signal."""
    rewards, advantages = [], []
    for value in (0.1, 0.7, 0.3):
        components = {"a": np.array([value, value, value, nan]), "b": np.array([0.2, 0.2, 0.2, 0.2])}
        summed = np.nansum(np.stack(list(components.values())), axis=0)
        assert group_drop_reason(summed) is None
        rewards.append(summed)
        advantages.append(gdpo(summed, components=components))
    step_rewards, step_advantages = np.concatenate(rewards), np.concatenate(advantages)
    assert not step_advantages.any()
    shift, scale = step_affine(StepRule.zscore, step_rewards, step_advantages)
    assert not ((step_advantages - shift) / scale).any()  # was +-0.58
    assert not group_mean(np.array([0.1, 0.1, 0.1])).any() and not rloo(np.array([0.1, 0.1, 0.1])).any()


def test_gdpo_needs_matching_components():
    with pytest.raises(ValueError, match="per-function rewards"):
        gdpo(np.array([1.0, 0.0]), components={})
    with pytest.raises(ValueError, match="'format'"):
        gdpo(np.array([1.0, 0.0]), components={"format": np.array([1.0, 0.0, 1.0])})


def test_the_rollout_loop_calls_every_estimator_with_the_per_function_rewards():
    group = SimpleNamespace(rewards=np.array([1.0, 0.0]), reward_components={"a": np.array([1.0, 0.0])})
    for name in ADVANTAGES.names():
        loop = SimpleNamespace(advantage_fn=ADVANTAGES.build({"name": name}))
        advantages = AsyncRolloutLoop.compute_advantages(loop, group)
        assert advantages.shape == (2,) and advantages[0] > advantages[1], name
    estimator = ADVANTAGES.build("group_mean")
    assert estimate_advantages(estimator, np.array([1, 3]), {}).dtype == np.float64


def test_scoring_a_group_keeps_the_per_function_rewards():
    group = SimpleNamespace(prompts=[[]] * 2, completions=[[]] * 2, completions_ids=[[1], [1, 2]], reward_kwargs={},
                            rollout_rewards=[None, None], env_rewards=[None, None], row_index=0,
                            rollouts=[])  # fmt: skip
    sources = [RewardSource("len", lambda completion_ids, **_: [float(len(c)) for c in completion_ids]),
               RewardSource("none", lambda completion_ids, **_: [None, 1.0])]  # fmt: skip
    asyncio.run(score_group(group, sources))
    close(group.reward_components["len"], [1.0, 2.0])
    assert math.isnan(group.reward_components["none"][0])
    close(group.rewards, [1.0, 3.0])


def test_silent_rewards_name_the_sources_without_signal_and_what_they_gave():
    components = {"length": np.array([0.0, 0.0, 0.0]), "accuracy": np.array([nan, 1.0, nan]),
                  "format": np.array([0.0, 1.0, 1.0])}  # fmt: skip
    assert silent_rewards(components) == (("length", "accuracy"), "length=0, accuracy=None for 2 of 3")
    assert silent_rewards({"format": np.array([0.0, 1.0])}) == ((), "")
