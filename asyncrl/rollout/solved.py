"""When a group is solved, and the opt-in retirement of prompts solved k times in a row (``data.retire_solved_after``).

A group is *solved* when every rollout of it scored the same reward R (it is dropped: zero_std) and R is the top of
the run: no rollout has scored more, and some rollout has scored less. The second half tells a solved task from a
reward that gives no signal: a reward constant from the first group (0 everywhere, or a value the model cannot move)
has no lower score beside it, and a group stuck at a middle value has a higher one. For accuracy and format rewards
the top is their maximum as soon as one rollout reaches it. Only rewards are seen, never their declared range: a
task whose maximum no rollout has reached has no solved groups.

Both sides use the rule: the trainer's group watch ends a run whose groups are all solved as a success
(trainer/group_watch.py), and the worker retires solved prompts (``RetireSolved``).

Retiring follows POLARIS (easy prompts are removed from the training data as the model masters them), not DAPO's
dynamic sampling (over-sample, discard the groups whose rewards are all equal, until the batch is full): asyncrl
already drops every zero-spread group and generates on, which is DAPO's filter, and what it still pays near
convergence is the generation of prompts the model has solved; only skipping them saves it. As in POLARIS, only
solved prompts retire, never all-wrong ones: a prompt the model fails today may carry signal after more training,
while a solved one stays solved. k times in a row, not once, keeps in the data a prompt solved by luck at temperature
1. The streaks live in the worker: a resumed run counts them again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RewardRange:
    """The lowest and highest reward any rollout of the run has scored (NaN, not applicable, is left out)."""

    lowest: float = math.inf
    highest: float = -math.inf

    def see(self, rewards: Iterable[float]) -> None:
        for reward in rewards:
            if not math.isnan(reward):
                self.lowest, self.highest = min(self.lowest, reward), max(self.highest, reward)

    def is_top(self, reward: float | None) -> bool:
        """Whether a group whose rollouts all scored ``reward`` is solved (after ``see`` of its rewards)."""
        return reward is not None and reward >= self.highest and self.lowest < reward

    def to_json(self) -> list[float] | None:
        """For a checkpoint: a resumed run keeps knowing which reward is the top (None before any reward)."""
        return [self.lowest, self.highest] if math.isfinite(self.lowest) else None

    @classmethod
    def from_json(cls, saved: list[float] | None) -> RewardRange:
        return cls(*saved) if saved else cls()


def common_reward(rewards: np.ndarray) -> float | None:
    """The one reward every scored rollout of a zero_std group got; None when fewer than two were scored."""
    scored = rewards[~np.isnan(rewards)]
    return float(scored[0]) if scored.size >= 2 and np.all(scored == scored[0]) else None


@dataclass
class RetireSolved:
    """``after``: retire a prompt (dataset row) once its last ``after`` groups were solved; None: never."""

    after: int | None
    rewards: RewardRange = field(default_factory=RewardRange)
    streaks: dict[int, int] = field(default_factory=dict)
    """Solved groups in a row, per dataset row that has any."""

    def retired(self, row_index: int) -> bool:
        return self.after is not None and self.streaks.get(row_index, 0) >= self.after

    def on_group(self, row_index: int, rewards: np.ndarray) -> None:
        """A scored group of the row: its streak grows if it is solved, and ends if not."""
        self.rewards.see(rewards.tolist())
        if self.rewards.is_top(common_reward(rewards)):
            self.streaks[row_index] = self.streaks.get(row_index, 0) + 1
        else:
            self.streaks.pop(row_index, None)
