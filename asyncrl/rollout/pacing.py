"""Pace generation by the lag of finished groups, so that no group is generated only to be dropped.

The trainer drops a sample more than ``max_staleness`` weight syncs old when it pulls it (spec,
"Staleness"), and a sample only ages in the queue, so a group queued more than max_staleness syncs after it
started is dropped whole. In a generation-bound run a group's lag is about its longest rollout's tokens x
rollouts in flight / tokens per step: with fewer rollouts in flight the steps come slower relative to one
rollout. The token allowance cannot prevent it (groups finish out of their start order), so the worker
keeps a second cap on rollouts in flight, fed by each queued group's lag.

``StalenessPacer`` is pure, additive-increase / multiplicative-decrease. A late group cuts the cap to 70%
of the rollouts that were in flight with it (at least one group). A late group that started under the
version of the last cut or earlier ran under the old concurrency, so it does not cut again; one started
later was admitted under the new cap, so the rollouts in flight have drained below it first. After
cap-many completed rollouts and max_staleness + 1 syncs without a late group (a group started after a
change is late no sooner than that) the cap grows by one group, up to ``max_concurrent_rollouts``, so it
settles under the lag limit instead of sawtoothing. Admission waits on min(this cap, the KV-load cap).

A group queued exactly at the limit is not a signal: it is trained if the trainer pulls it before its next
sync, which the worker cannot see, and at max_staleness=1 such groups are the norm. Samples that age in
the queue are admission's part (admission.py). Synchronous mode (max_staleness=0) has no lag and no pacer
(``WorkerFlow`` in admission.py). The staleness rule itself is ``FlowControl``'s (flow.py): the pacer asks it.
"""

from __future__ import annotations

import math

from asyncrl.flow import FlowControl

CUT_FACTOR = 0.7


class StalenessPacer:
    """The cap starts at ``ceiling``; versions are weight syncs done (``channels.model_version``)."""

    def __init__(self, ceiling: int, flow: FlowControl) -> None:
        self.ceiling, self.num_generations, self.flow = ceiling, flow.num_generations, flow
        self.cap = ceiling
        self.late_groups = 0
        self._version_at_cut = -1
        self._version_at_change = 0
        self._completed_at_change = 0

    @property
    def floor(self) -> int:
        """One group: a lower cap would stop generation altogether."""
        return min(self.num_generations, self.ceiling)

    def on_group_done(self, start_version: int, version: int, inflight: int, completed: int) -> bool:
        """Move the cap for a group queued at ``version`` that started at ``start_version``; True if it is
        late. ``inflight``: rollouts still in flight, not counting its own; ``completed``: rollouts finished
        since the start, counting its own."""
        if self.flow.is_stale(start_version, version):
            self.late_groups += 1
            if start_version > self._version_at_cut:
                base = min(self.cap, inflight + self.num_generations)
                self.cap = max(self.floor, math.floor(base * CUT_FACTOR))
                self._version_at_cut = version
            self._version_at_change, self._completed_at_change = version, completed
            return True
        if self._may_grow(version, completed):
            self.cap = min(self.ceiling, self.cap + self.num_generations)
            self._version_at_change, self._completed_at_change = version, completed
        return False

    def _may_grow(self, version: int, completed: int) -> bool:
        settled = self.flow.is_stale(self._version_at_change, version)  # a group started since may be late
        return self.cap < self.ceiling and settled and completed - self._completed_at_change >= self.cap
