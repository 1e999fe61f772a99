"""Advantage estimators (one advantage per rollout of a group) and the rule that drops groups with no signal.

The rollout worker sums each rollout's rewards (NaN where every reward function returned None), drops the
group if ``group_drop_reason`` gives a reason, and otherwise asks the rollout loop, which calls the configured
``Estimator`` through ``estimate_advantages``. An estimator that normalises over a batch declares a
``step_rule``: the worker computes the group part and the trainer's ``StepLoss`` finishes it over each
optimizer step's rollouts, the asynchronous counterpart of a synchronous trainer's generation batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from asyncrl.registry import Component, ComponentRegistry

EPSILON = 1e-8


class StepRule(StrEnum):
    """How the trainer finishes an estimator's advantages over each optimizer step (see ``step_affine``)."""

    reward_std = "reward_std"
    zscore = "zscore"


class Estimator(Component, ABC):
    """A registered advantage estimator: ``estimator(rewards, components)`` -> one advantage per rollout.

    ``rewards``: the summed reward per rollout (NaN = unscorable); ``components``: one reward array per reward
    function, as ``RolloutGroup.reward_components``. ``step_rule``: set when the trainer normalises the output
    over each optimizer step's rollouts; None when the group's advantages are final.
    """

    step_rule: ClassVar[StepRule | None] = None
    reward_weights: Mapping[str, float] = MappingProxyType({})
    """Each reward function's weight (reward_weights), by name; set where the run's components are built. ``rewards``
    carries them already; an estimator that reads ``components`` (unweighted) applies them itself. A source not named
    (an environment's or a rollout's own reward) weighs 1."""

    @abstractmethod
    def __call__(self, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
        """One advantage per rollout."""


ADVANTAGES: ComponentRegistry[Estimator] = ComponentRegistry("advantage", Estimator)


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
    """``transform`` of the scorable rewards in place of them; 0 for unscorable rollouts, and exactly 0 for all of
    them when the scorable ones are equal: their mean can differ from them by a rounding error (0.1 three times
    averages to 0.1 - 1.4e-17), which a division by std + 1e-8 would turn into advantages of 1e-9 that a step's
    z-score (gdpo) then blows up to about +-1."""
    rewards = np.asarray(rewards, dtype=np.float64)
    kept = scorable(rewards)
    advantages = np.zeros_like(rewards)
    if kept.any() and not np.all(rewards[kept] == rewards[kept][0]):
        advantages[kept] = transform(rewards[kept])
    return advantages


# ---- how an estimator is called ------------------------------------------------------------------------------


def estimate_advantages(
    estimator: Estimator, rewards: np.ndarray, components: Mapping[str, np.ndarray]
) -> np.ndarray:  # fmt: skip
    """One float64 advantage per rollout."""
    return np.asarray(estimator(rewards, components), dtype=np.float64)


def step_affine(rule: StepRule, rewards: np.ndarray, advantages: np.ndarray) -> tuple[float, float]:
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
    raise ValueError(f"step rule {rule!r} is not one of {', '.join(StepRule)}")


# ---- the estimators ------------------------------------------------------------------------------------------


def group_zscore(rewards: np.ndarray) -> np.ndarray:
    """GRPO's group z-score (r - mean) / (std + 1e-8) over scorable rollouts; 0 for unscorable ones.

    std is the population std (ddof=0) as in TRL's async trainer, not GRPOTrainer's Bessel-corrected one.
    """
    return over_scorable(rewards, lambda v: (v - v.mean()) / (v.std(ddof=0) + EPSILON))


def group_mean(rewards: np.ndarray) -> np.ndarray:
    """r - mean over scorable rollouts; 0 for unscorable ones."""
    return over_scorable(rewards, lambda v: v - v.mean())


def rloo(rewards: np.ndarray) -> np.ndarray:
    """r_i minus the mean of the other scorable rollouts, = n / (n - 1) (r_i - mean); 0 when n < 2."""
    return over_scorable(rewards, lambda v: v - (v.sum() - v) / (v.size - 1) if v.size > 1 else np.zeros_like(v))


def gdpo(
    rewards: np.ndarray, *, components: Mapping[str, np.ndarray], weights: Mapping[str, float] = MappingProxyType({})
) -> np.ndarray:  # fmt: skip
    """The sum over reward functions of each one's group z-score times its weight (1 where ``weights`` names it
    not), as TRL's normalize_then_sum; 0 for an unscorable rollout (NaN sum).

    A function's NaN (not applicable) entries are left out of its own mean and std and contribute 0.
    """
    if not components:
        raise ValueError("advantage 'gdpo' needs the per-function rewards (RolloutGroup.reward_components); got none")
    total = np.zeros(len(np.asarray(rewards)), dtype=np.float64)
    for name, values in components.items():
        values = np.asarray(values, dtype=np.float64)
        if values.shape != total.shape:
            raise ValueError(f"advantage 'gdpo': rewards of '{name}' have shape {values.shape}, expected {total.shape}")
        total += weights.get(name, 1.0) * group_zscore(values)
    return np.where(scorable(rewards), total, 0.0)


@ADVANTAGES.register("group_zscore")
class GroupZscore(Estimator):
    """GRPO: ``group_zscore`` of the summed rewards."""

    def __call__(self, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
        return group_zscore(rewards)


@ADVANTAGES.register("group_mean")
class GroupMean(Estimator):
    """Dr. GRPO: ``group_mean``, no std, so hard and easy prompts are not rescaled."""

    def __call__(self, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
        return group_mean(rewards)


@ADVANTAGES.register("rloo")
class Rloo(Estimator):
    """RLOO: the leave-one-out baseline (``rloo``)."""

    def __call__(self, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
        return rloo(rewards)


@ADVANTAGES.register("group_mean_batch_std")
class GroupMeanBatchStd(Estimator):
    """LitePPO: r - group mean here, divided by the std of all rewards of the optimizer step at the trainer."""

    step_rule = StepRule.reward_std

    def __call__(self, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
        return group_mean(rewards)


@ADVANTAGES.register("gdpo")
class Gdpo(Estimator):
    """GDPO: ``gdpo`` (each reward function's group z-score, summed), z-scored over the step at the trainer.

    Normalising each function before summing keeps distinct reward combinations distinct (summing first can
    map them to equal advantages).
    """

    step_rule = StepRule.zscore

    def __call__(self, rewards: np.ndarray, components: Mapping[str, np.ndarray]) -> np.ndarray:
        return gdpo(rewards, components=components, weights=self.reward_weights)
