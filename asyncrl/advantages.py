"""Advantage estimators (one advantage per rollout of a group) and the rule that drops groups with no signal.

The rollout worker sums each rollout's rewards (NaN where every reward function returned None), drops the
group if ``group_drop_reason`` gives a reason, and otherwise asks the rollout loop, which calls the configured
estimator through ``estimate_advantages``. An estimator that normalises over a batch declares a ``step_rule``:
the worker computes the group part and the trainer's ``StepLoss`` finishes it over each optimizer step's
rollouts, the asynchronous counterpart of a synchronous trainer's generation batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from asyncrl.registry import Registry

AdvantageFn = Callable[..., np.ndarray]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")
STEP_RULES = ("reward_std", "zscore")
EPSILON = 1e-8
F = TypeVar("F", bound=Callable[..., Any])


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


def silent_rewards(components: Mapping[str, np.ndarray]) -> tuple[tuple[str, ...], str]:
    """The reward sources that leave a group without signal, and what they gave: one value for every rollout
    they scored (``length=0``), or too few scores (``accuracy=None for 7 of 8``)."""
    names, notes = [], []
    for name, values in components.items():
        kept = values[~np.isnan(values)]
        if kept.size < 2:
            notes.append(f"{name}=None for {values.size - kept.size} of {values.size}")
        elif np.all(kept == kept[0]):
            notes.append(f"{name}={kept[0]:g}")
        else:
            continue
        names.append(name)
    return tuple(names), ", ".join(notes)


def over_scorable(rewards: np.ndarray, transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``transform`` of the scorable rewards in place of them; 0 for unscorable rollouts."""
    rewards = np.asarray(rewards, dtype=np.float64)
    kept = scorable(rewards)
    advantages = np.zeros_like(rewards)
    if kept.any():
        advantages[kept] = transform(rewards[kept])
    return advantages


# ---- how an estimator is called ------------------------------------------------------------------------------


def per_reward_function(fn: F) -> F:
    """Mark an estimator that takes ``components`` (one reward array per reward function) besides the sum."""
    fn.uses_components = True  # type: ignore[attr-defined]
    return fn


def finished_per_step(rule: str) -> Callable[[F], F]:
    """Mark an estimator whose output the trainer normalises over each step's rollouts (see ``step_affine``)."""
    if rule not in STEP_RULES:
        raise ValueError(f"step rule {rule!r} is not one of {STEP_RULES}")

    def decorator(fn: F) -> F:
        fn.step_rule = rule  # type: ignore[attr-defined]
        return fn

    return decorator


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def step_rule(fn: Callable[..., Any] | None) -> str | None:
    return None if fn is None else getattr(_unwrapped(fn), "step_rule", None)


def estimate_advantages(fn: AdvantageFn, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
    """One advantage per rollout, passing the per-function rewards to estimators that ask for them."""
    if getattr(_unwrapped(fn), "uses_components", False):
        return np.asarray(fn(rewards, components=components), dtype=np.float64)
    return np.asarray(fn(rewards), dtype=np.float64)


def step_affine(rule: str, rewards: np.ndarray, advantages: np.ndarray) -> tuple[float, float]:
    """(shift, scale) with A' = (A - shift) / scale over a step's rollouts, from its scorable ones.

    reward_std (LitePPO): shift 0, scale = std of the summed rewards + 1e-8. zscore (GDPO): the advantages'
    mean and std + 1e-8. Population std (ddof=0), as the group estimators use.
    """
    kept = scorable(rewards)
    if not kept.any():
        return 0.0, 1.0
    if rule == "reward_std":
        return 0.0, float(np.asarray(rewards)[kept].std()) + EPSILON
    if rule == "zscore":
        values = np.asarray(advantages, dtype=np.float64)[kept]
        return float(values.mean()), float(values.std()) + EPSILON
    raise ValueError(f"step rule {rule!r} is not one of {STEP_RULES}")


# ---- the estimators ------------------------------------------------------------------------------------------


@ADVANTAGES.register("group_zscore")
def group_zscore(rewards: np.ndarray) -> np.ndarray:
    """GRPO's group z-score (r - mean) / (std + 1e-8) over scorable rollouts; 0 for unscorable ones.

    std is the population std (ddof=0) as in TRL's async trainer, not GRPOTrainer's Bessel-corrected one.

    Args:
        rewards: one summed reward per rollout of the group, NaN where the rollout is unscorable.
    """
    return over_scorable(rewards, lambda v: (v - v.mean()) / (v.std(ddof=0) + EPSILON))


@ADVANTAGES.register("group_mean")
def group_mean(rewards: np.ndarray) -> np.ndarray:
    """Dr. GRPO: r - mean over scorable rollouts, no std, so hard and easy prompts are not rescaled."""
    return over_scorable(rewards, lambda v: v - v.mean())


@ADVANTAGES.register("rloo")
def rloo(rewards: np.ndarray) -> np.ndarray:
    """RLOO: r_i minus the mean of the other scorable rollouts, = n / (n - 1) (r_i - mean); 0 when n < 2."""
    return over_scorable(rewards, lambda v: v - (v.sum() - v) / (v.size - 1) if v.size > 1 else np.zeros_like(v))


@ADVANTAGES.register("group_mean_batch_std")
@finished_per_step("reward_std")
def group_mean_batch_std(rewards: np.ndarray) -> np.ndarray:
    """LitePPO: r - group mean here, divided by the std of all rewards of the optimizer step at the trainer."""
    return over_scorable(rewards, lambda v: v - v.mean())


@ADVANTAGES.register("gdpo")
@per_reward_function
@finished_per_step("zscore")
def gdpo(rewards: np.ndarray, *, components: Mapping[str, np.ndarray]) -> np.ndarray:
    """GDPO: the sum over reward functions of each one's group z-score, z-scored over the step at the trainer.

    Normalising each function before summing keeps distinct reward combinations distinct (summing first can
    map them to equal advantages). A function's NaN (not applicable) entries are left out of its own mean and
    std and contribute 0.

    Args:
        rewards: the summed reward per rollout (NaN = unscorable: advantage 0).
        components: one reward array per reward function, as ``RolloutGroup.reward_components``.
    """
    if not components:
        raise ValueError("advantage 'gdpo' needs the per-function rewards (RolloutGroup.reward_components); got none")
    total = np.zeros(len(np.asarray(rewards)), dtype=np.float64)
    for name, values in components.items():
        values = np.asarray(values, dtype=np.float64)
        if values.shape != total.shape:
            raise ValueError(f"advantage 'gdpo': rewards of '{name}' have shape {values.shape}, expected {total.shape}")
        total += group_zscore(values)
    return np.where(scorable(rewards), total, 0.0)
