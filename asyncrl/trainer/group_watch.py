"""Stop a run whose groups can no longer train, with the reason, instead of waiting for a step that never comes.

The trainer learns each group's fate in the order the worker sent it: a ``PromptDone`` for a group the worker
dropped (zero_std, too_few_scorable: its rewards carry no signal; failed: its generation failed after the
client's retries; prompt_too_long: skipped) and samples for the others, which the trainer drops itself when they
arrive too stale or too long for any row (stale, oversize). Two rules end the run:

- ``rollout.max_consecutive_dropped_groups`` groups in a row gave nothing to train. A count, not a time: a
  group of long reasoning rollouts can take minutes, while a count is the same evidence at any speed (at a
  95% drop rate 256 drops in a row happen by chance once in ~10^5 groups). Where every one of them was solved
  (zero_std at the run's top reward, rollout/solved.py: the model answers every prompt as well as any rollout
  ever did) the task is done, not stalled: ``TaskSolved`` ends the run as a success (rollout.stop_when_solved).
  Any other such window (all-zero or all-equal groups below the top, groups no reward scored, stale or oversize
  samples) is a stall: the trainer saves what it trained, then ends with ``TrainingStalledError``.
- more than ``rollout.max_failed_group_fraction`` of the last ``FAILURE_WINDOW`` groups failed to generate.
  A failed group is dropped and counted (rollout/failed_group_count) rather than ending the run, so that one
  bad request costs one group.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from asyncrl.rollout.solved import RewardRange

FAILURE_WINDOW = 100
"""Groups over which the failure fraction is measured (a run's first groups count against the full window, so
one early failure is not a 100% rate)."""


WHY = {
    "zero_std": "the rewards gave every rollout of a prompt the same value",
    "too_few_scorable": "the rewards returned None for all but at most one rollout of a prompt",
    "failed": "its generation requests failed",
    "prompt_too_long": "the prompt exceeds data.max_prompt_length or the server's context",
    "stale": "its samples arrived more than staleness.max_staleness versions old",
    "oversize": "its samples do not fit a row (packing.token_budget)",
}
"""What each drop reason means, for the message of the run they stop."""


class TrainingStalledError(RuntimeError):
    """No group could train for too long, or too many failed to generate; the message says why."""


class TaskSolved(Exception):
    """Every group of the last rollout.max_consecutive_dropped_groups was solved: the run ends as a success; the
    message is the line that says so."""


class GenerationFailingError(TrainingStalledError):
    """Too many groups failed to generate: the server errs or stopped answering, which a restart of the run's
    processes may fix (trainer.max_restarts), unlike rewards that give no signal."""


@dataclass
class _Reason:
    count: int = 0
    rewards: Counter[str] = field(default_factory=Counter)
    last: str = ""


class GroupWatch:
    def __init__(self, max_consecutive_dropped: int | None, max_failed_fraction: float, stop_when_solved: bool = True,
                 rewards: RewardRange | None = None) -> None:  # fmt: skip
        self.max_consecutive_dropped, self.max_failed_fraction = max_consecutive_dropped, max_failed_fraction
        self.stop_when_solved = stop_when_solved
        self.rewards = rewards or RewardRange()
        """Every reward the trainer has seen, samples' and dropped groups' (a checkpoint keeps it)."""
        self.failures: deque[bool] = deque(maxlen=FAILURE_WINDOW)
        self.dropped: dict[str, _Reason] = {}
        """Why each group since the last trainable one was dropped."""
        self.levels: Counter[float | None] = Counter()
        """The common reward of each zero_std group since the last trainable one; None for other drops."""
        self._sample_group: int | None = None

    def on_dropped(self, reason: str, rewards: tuple[str, ...] = (), detail: str = "",
                   reward: float | None = None) -> None:  # fmt: skip
        """A group that gives nothing to train (``reward``: the one its rollouts all scored, if zero_std); raises
        once the rules say the run cannot go on, or is done."""
        entry = self.dropped.setdefault(reason, _Reason())
        entry.count += 1
        entry.rewards.update(rewards)
        entry.last = detail or entry.last
        self.rewards.see([] if reward is None else [reward])
        self.levels[reward if reason == "zero_std" else None] += 1
        self.failures.append(reason == "failed")
        if reason == "failed" and sum(self.failures) > self.max_failed_fraction * FAILURE_WINDOW:
            raise GenerationFailingError(
                f"{sum(self.failures)} of the last {len(self.failures)} groups failed to generate "
                f"(rollout.max_failed_group_fraction={self.max_failed_fraction:g} of {FAILURE_WINDOW}); "
                f"last error: {entry.last}"
            )
        in_a_row = sum(e.count for e in self.dropped.values())
        if self.max_consecutive_dropped is not None and in_a_row >= self.max_consecutive_dropped:
            solved = self.solved_line()
            if solved is not None and self.stop_when_solved:
                raise TaskSolved(solved)
            most = max(self.dropped, key=lambda name: self.dropped[name].count)
            raise TrainingStalledError(
                f"no trainable group in the last {in_a_row} (rollout.max_consecutive_dropped_groups="
                f"{self.max_consecutive_dropped}): {self.summary()}. {most}: {WHY.get(most, most)}; fix that, "
                "or raise the threshold (null: never stop)"
            )

    def solved_line(self) -> str | None:
        """The line saying the task is solved, if every group dropped since the last trainable one was solved: zero_std
        at the top reward of the run (rollout/solved.py); else None."""
        if len(self.levels) != 1 or not self.rewards.is_top(level := next(iter(self.levels))):
            return None
        scores = self.dropped["zero_std"].last
        return (
            f"the task is solved for this model: {self.levels[level]} groups in a row scored {level:g} for every "
            f"rollout{f' ({scores})' if scores else ''}, the highest reward of the run; training ends here "
            "(rollout.stop_when_solved=false: end as a stall)"
        )

    def on_sample(self, group_id: int, drop_reason: str | None, reward: float = math.nan) -> None:
        """A sample as it arrives (``reward``: its rollout's): its group counts once, as trainable or as dropped
        (stale, oversize)."""
        self.rewards.see([reward])
        if group_id == self._sample_group:
            return
        self._sample_group = group_id
        if drop_reason is not None:
            self.on_dropped(drop_reason)
            return
        self.failures.append(False)
        self.dropped.clear()
        self.levels.clear()

    def summary(self) -> str:
        """``zero_std 60 (rewards: length x60; last: length=0), failed 4 (last: ...)``, the largest count first."""
        parts = []
        for reason, entry in sorted(self.dropped.items(), key=lambda item: -item[1].count):
            notes = ["rewards: " + ", ".join(f"{name} x{n}" for name, n in entry.rewards.most_common())]
            notes = (notes if entry.rewards else []) + ([f"last: {entry.last}"] if entry.last else [])
            parts.append(f"{reason} {entry.count}" + (f" ({'; '.join(notes)})" if notes else ""))
        return ", ".join(parts)
