"""Advantage estimators (one advantage per rollout of a group) and the rule that drops groups with no signal.

The rollout worker sums each rollout's rewards (NaN where every reward function returned None), drops the
group if ``group_drop_reason`` gives a reason, and otherwise calls ``ADVANTAGES.build(config.advantage)(rewards)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from asyncrl.registry import Registry

AdvantageFn = Callable[..., np.ndarray]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")


def scorable(rewards: np.ndarray) -> np.ndarray:
    """Mask of the rollouts that have a reward (NaN marks an unscorable rollout)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"advantage estimators take one reward per rollout (1-D), got shape {rewards.shape}")
    if np.isinf(rewards).any():
        raise ValueError(f"rewards must be finite or NaN (unscorable), got {rewards.tolist()}")
    return ~np.isnan(rewards)


def group_drop_reason(rewards: np.ndarray) -> str | None:
    """Why a group gives no learning signal: "too_few_scorable" (< 2 rewards) or "zero_std" (all equal); else None."""
    rewards = np.asarray(rewards, dtype=np.float64)
    kept = rewards[scorable(rewards)]
    if kept.size < 2:
        return "too_few_scorable"
    if np.all(kept == kept[0]):
        return "zero_std"
    return None


@ADVANTAGES.register("group_zscore")
def group_zscore(rewards: np.ndarray) -> np.ndarray:
    """GRPO's group z-score (r - mean) / (std + 1e-8) over scorable rollouts; 0 for unscorable ones.

    std is the population std (ddof=0) as in TRL's async trainer, not GRPOTrainer's Bessel-corrected one.

    Args:
        rewards: one summed reward per rollout of the group, NaN where the rollout is unscorable.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    kept = scorable(rewards)
    advantages = np.zeros_like(rewards)
    if kept.any():
        values = rewards[kept]
        advantages[kept] = (values - values.mean()) / (values.std(ddof=0) + 1e-8)
    return advantages
