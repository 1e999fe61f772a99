"""The micro-batch planner: which of the `dp` rows (one per rank) each sample goes to, and when to close.

A sample joins the row that already holds its group, where its prompt is. When that row is full it goes to
another row only if some rank still has an empty row or if doing so does not raise the most loaded row
(attention cost sets the micro-batch time); otherwise the micro-batch closes and the sample opens the next.
A sample of a new group goes to the row it loads least. With dp=1 this is "close when the row is full".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from asyncrl.rollout.types import RolloutSample

if TYPE_CHECKING:
    from asyncrl.packing import Row, RowFactory


def causal_pairs(length: int, shared: int = 0) -> int:
    """Query-key pairs that tokens shared..length-1 of a sequence attend to (the O(L^2) attention work)."""
    return (length * (length + 1) - shared * (shared + 1)) // 2


class MicroBatchPlanner:
    """Online planner over `dp` open rows; `offer` returns a micro-batch when one closes."""

    def __init__(self, row_factory: RowFactory, dp: int, token_budget: int) -> None:
        if dp < 1:
            raise ValueError(f"MicroBatchPlanner: dp must be >= 1, got {dp}")
        self.row_factory, self.dp, self.token_budget = row_factory, dp, token_budget
        self.dropped_oversize = 0
        self._open()

    def offer(self, sample: RolloutSample) -> list[Row] | None:
        """Place the sample; if the open micro-batch had to close first, return its rows."""
        if sample.num_tokens > self.token_budget:
            self.dropped_oversize += 1
            return None
        closed = None
        target = self._choose(sample)
        if target is None:
            closed = self.flush()
            target = self._choose(sample)
            if target is None:
                raise ValueError(
                    f"MicroBatchPlanner: a {sample.num_tokens}-token sample does not fit an empty row, so the "
                    f"row factory's budget is below token_budget={self.token_budget}"
                )
        self._place(sample, target)
        return closed

    def fits(self, sample: RolloutSample) -> bool:
        """Whether ``offer`` would place the sample without closing the open micro-batch."""
        return sample.num_tokens <= self.token_budget and self._choose(sample) is not None

    def flush(self) -> list[Row] | None:
        """Close the open micro-batch (None if it holds nothing); ranks without a sample get an empty row."""
        rows = self.rows
        self._open()
        return rows if any(row.samples for row in rows) else None

    def _open(self) -> None:
        self.rows: list[Row] = [self.row_factory() for _ in range(self.dp)]
        self.loads = [0] * self.dp
        self._group_row: dict[int, int] = {}

    def _choose(self, sample: RolloutSample) -> int | None:
        home = self._group_row.get(sample.group_id)
        if home is not None and self.rows[home].fits(sample):
            return home
        fitting = [r for r in range(self.dp) if self.rows[r].fits(sample)]
        if not fitting:
            return None
        best = min(fitting, key=lambda r: self.loads[r] + self._added_load(r, sample))
        if home is None or not all(row.samples for row in self.rows):
            return best
        return best if self.loads[best] + self._added_load(best, sample) <= max(self.loads) else None

    def _place(self, sample: RolloutSample, target: int) -> None:
        self.loads[target] += self._added_load(target, sample)
        self.rows[target].add(sample)
        self._group_row[sample.group_id] = target

    def _added_load(self, row: int, sample: RolloutSample) -> int:
        return causal_pairs(sample.num_tokens, _shared_prefix(self.rows[row], sample))


def _shared_prefix(row: Row, sample: RolloutSample) -> int:
    """Tokens of the sample the row already forwards: a tree row shares prefixes, a flat row shares nothing."""
    shared = getattr(row, "shared_prefix", None)
    return shared(sample) if shared is not None else 0


def plan_micro_batches(
    samples: Iterable[RolloutSample], row_factory: RowFactory, dp: int, token_budget: int
) -> tuple[list[list[Row]], int]:
    """Plan a whole stream at once: the micro-batches and how many oversize samples were dropped."""
    planner = MicroBatchPlanner(row_factory, dp, token_budget)
    micro_batches = [closed for sample in samples if (closed := planner.offer(sample)) is not None]
    if (last := planner.flush()) is not None:
        micro_batches.append(last)
    return micro_batches, planner.dropped_oversize
