"""Admission control: when may the worker start another group? (spec, "Concurrency").

The trainer grants a token allowance of max(max_staleness, 1) steps' worth of consumed tokens; the worker
starts a group only while its queued plus in-flight tokens are under it, and only while the rollouts in
flight stay under the concurrency cap. A finished rollout whose group still waits on a longer sibling (or is
being scored) is neither in flight nor queued, but its tokens still count: with long-tailed lengths most
of a group can sit there, and leaving it out would start more groups than the allowance, whose samples then
wait in the queue until they are too stale to train.

In asynchronous mode the tokens held when a weight sync comes are what the next max_staleness steps must
train before they go stale, so admission stays inside the allowance rather than at it: it counts the group
about to start (a group that overshoots would be dropped at the far end; when nothing is queued or in
flight a group starts whatever its size), and it holds the smallest of the last few grants, since a grant
is max_staleness x the last step's tokens and the next steps may take fewer (rows of tree packing hold
10-20% more or fewer sample tokens from step to step). Synchronous mode closes its batch at the allowance
and trains the overshoot.

Until the first group completes, the size of a rollout is unknown. The spec starts groups one at a time until then;
where the rollout loop bounds a rollout's tokens (``rollout_token_bound``: a turn holds at most the server's
``max_model_len``, a turn without tools at most data.max_prompt_length and the completion budget, and the built-in
loop's turns are one, or ``max_tool_calling_iterations`` + 1 with tools), the rollouts in flight count at that bound
instead, so the first step's groups start together inside the same allowance. One at a time, the first step waits
for two generations of its longest rollout: the first group's, then everyone else's (16.8 s of a 21.7 s first step
at the Qwen3.5-2B shape, benchmarks/RESULTS.md). With no bound (a loop's own ``generate_one``, tools without an
iteration cap) groups still start one at a time.

Groups dropped for lack of signal (zero_std: near convergence most groups score the same for every rollout) send the
trainer nothing: admission counts the tokens in flight, and those of finished rollouts waiting for their group, at the
share that the last ``KEPT_WINDOW`` groups sent the trainer (``kept_fraction``), and a dropped group frees its share
of the allowance as soon as it is scored. Counted at full size, a run dropping 70% of its groups would hold 70% of its
allowance in groups the trainer never sees, and its steps would wait on generation 3.3x as long (benchmarks/
drop_rate.py). Staleness is what the allowance bounds, and it still does: what reaches the queue is about the
allowance; the caps on rollouts in flight (the server's load, the groups' lag) bound the larger generation.
``MIN_KEPT_FRACTION`` bounds it too: a run that suddenly keeps every group again has at most 1 / MIN_KEPT_FRACTION
allowances in flight, whose late samples go stale (and cut the staleness pacer's cap).

``WorkerFlow`` is the worker's side of the run's ``FlowControl`` (flow.py): it holds this bookkeeping and both
caps on rollouts in flight, and gives the one answer the worker waits on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from asyncrl.flow import FlowControl
from asyncrl.rollout.concurrency import ConcurrencyController
from asyncrl.rollout.pacing import StalenessPacer

RECENT_GRANTS = 4
KEPT_WINDOW = 32
"""Groups over which the kept share of generated tokens is measured."""
MIN_KEPT_FRACTION = 0.1
"""At most 10x the allowance in flight: up to a 90% drop rate a step waits no longer than with none dropped."""


@dataclass
class Admission:
    num_generations: int
    max_concurrent_rollouts: int
    asynchronous: bool = False
    inflight_groups: int = 0
    inflight_rollouts: int = 0
    completed_groups: int = 0
    tokens_pushed: int = 0
    rollouts_seen: int = 0
    mean_rollout_tokens: float = 0.0
    squared_rollout_tokens: float = 0.0
    """Mean of the squared rollout sizes: with the mean, the size of a rollout caught in flight."""
    unqueued_tokens: int = 0
    """Tokens of finished rollouts whose group is not queued yet."""
    grants: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_GRANTS))
    """The trainer's recent grants; until its first, the initial allowance alone."""
    granted: bool = False
    outcomes: deque[tuple[int, bool]] = field(default_factory=lambda: deque(maxlen=KEPT_WINDOW))
    """(tokens generated, sent to the trainer) of the last groups."""
    groups_sent: int = 0
    """Groups whose samples went to the trainer (not dropped)."""
    rollout_token_bound: int | None = None
    """The most tokens one rollout can hold (``AsyncRolloutLoop.max_rollout_tokens``); None: unknown."""

    def kept_fraction(self) -> float:
        """The share of generated tokens whose group the trainer got, over the last groups (1 before any)."""
        generated = sum(tokens for tokens, _ in self.outcomes)
        if not generated:
            return 1.0
        kept = sum(tokens for tokens, sent in self.outcomes if sent)
        return max(MIN_KEPT_FRACTION, kept / generated)

    def inflight_tokens(self) -> float:
        """Expected tokens of the rollouts in flight, from the rollouts seen so far. A rollout caught in
        flight is length-biased (long ones stay in flight longer): its expected size is E[L^2] / E[L], not
        the mean, which under a long tail would undercount them. Until a group completes, the rollouts seen are
        the shortest of their groups: those in flight count at the bound."""
        bound = self.first_bound()
        if bound is not None:
            return float(self.inflight_rollouts * bound)
        if self.mean_rollout_tokens == 0:
            return 0.0
        return self.inflight_rollouts * self.squared_rollout_tokens / self.mean_rollout_tokens

    def starting_rollout_tokens(self) -> float:
        """What one rollout about to start is expected to hold: the bound until a group completes, then the mean."""
        bound = self.first_bound()
        return self.mean_rollout_tokens if bound is None else float(bound)

    def first_bound(self) -> int | None:
        """The bound on a rollout's tokens while no group has completed (the sizes seen are not yet a sample of
        whole groups); None once one has, or with no bound."""
        return self.rollout_token_bound if self.completed_groups == 0 else None

    def queued_tokens(self, tokens_consumed: int) -> int:
        return max(0, self.tokens_pushed - tokens_consumed)

    def holdable(self, allowance: int) -> int:
        """The tokens the worker may hold under the trainer's current ``allowance``."""
        if not self.asynchronous:
            return allowance
        if not self.grants or self.grants[-1] != allowance:
            if self.grants and not self.granted:
                # the initial allowance is a guess (rows x budget, blind to the packing ratio: tree rows hold
                # 2-3x that in samples); kept among the recent grants it would starve the first steps
                self.grants.clear()
                self.granted = True
            self.grants.append(allowance)
        return min(self.grants)

    def wait_reason(self, allowance: int, tokens_consumed: int, concurrency_cap: int) -> str | None:
        """None if a new group may start now, else what it waits on (the backpressure reason first)."""
        if self.completed_groups == 0 and self.inflight_groups > 0 and self.rollout_token_bound is None:
            return "first group"
        allowance, kept = self.holdable(allowance), self.kept_fraction()
        held = self.queued_tokens(tokens_consumed) + kept * (self.unqueued_tokens + self.inflight_tokens())
        starting = 0.0
        if self.asynchronous and held > 0:
            starting = kept * self.num_generations * self.starting_rollout_tokens()
        if held >= allowance or held + starting > allowance:
            return "backpressure"
        return self.concurrency_reason(concurrency_cap)

    def concurrency_reason(self, concurrency_cap: int) -> str | None:
        """Whether another group would take the rollouts in flight past the cap ("concurrency"), else None."""
        cap = min(concurrency_cap, self.max_concurrent_rollouts)
        if self.inflight_rollouts > 0 and self.inflight_rollouts + self.num_generations > cap:
            return "concurrency"
        return None

    def on_group_start(self) -> None:
        self.inflight_groups += 1
        self.inflight_rollouts += self.num_generations

    def on_rollout_done(self, num_tokens: int) -> None:
        self.inflight_rollouts -= 1
        self.rollouts_seen += 1
        self.mean_rollout_tokens += (num_tokens - self.mean_rollout_tokens) / self.rollouts_seen
        self.squared_rollout_tokens += (num_tokens**2 - self.squared_rollout_tokens) / self.rollouts_seen
        self.unqueued_tokens += num_tokens

    def on_rollout_failed(self) -> None:
        """A rollout that ended without a result (its group is dropped): it leaves the flight, adding no size."""
        self.inflight_rollouts -= 1

    def on_group_done(self, pushed_tokens: int, rollout_tokens: int) -> None:
        """The group is queued: ``rollout_tokens`` (its rollouts' tokens, as counted at ``on_rollout_done``)
        leave the unqueued count, and its samples' ``pushed_tokens`` (none when dropped) join the queue."""
        self.inflight_groups -= 1
        self.completed_groups += 1
        self.unqueued_tokens -= rollout_tokens
        self.tokens_pushed += pushed_tokens
        self.outcomes.append((rollout_tokens, pushed_tokens > 0))
        self.groups_sent += pushed_tokens > 0


class WorkerFlow:
    """The worker's side: may a group start now? It owns the token bookkeeping and both caps on rollouts in
    flight (the server's load moves ``concurrency`` through the load poller; the groups' lag moves ``pacer``,
    which synchronous mode has none of)."""

    def __init__(self, flow: FlowControl) -> None:
        self.flow, self.clock = flow, flow.clock
        ceiling, g = flow.max_concurrent_rollouts, flow.num_generations
        self.admission = Admission(g, ceiling, asynchronous=not flow.synchronous)
        self.concurrency = ConcurrencyController(ceiling)
        self.pacer = None if flow.synchronous else StalenessPacer(ceiling, flow)
        self.batch_start_tokens = 0
        """Synchronous mode: the tokens pushed before the current batch."""
        self.batch_start_groups = 0
        """Synchronous mode: the groups sent before the current batch (``FlowControl.batch_groups``)."""

    @property
    def pacing_cap(self) -> int:
        return self.flow.max_concurrent_rollouts if self.pacer is None else self.pacer.cap

    def released(self, tokens_consumed: int) -> int:
        """Tokens no longer counted against the allowance: consumed by the trainer (asynchronous mode), or every
        token of earlier batches (synchronous mode, where a batch is closed at the allowance even though the
        trainer pulls samples while it waits for the batch's end)."""
        return self.batch_start_tokens if self.flow.synchronous else tokens_consumed

    def wait_reason(self, allowance: int, tokens_consumed: int, scoring_full: bool) -> str | None:
        """None if a new group may start now, else what it waits on (the backpressure reason first)."""
        pacing = self.pacing_cap
        cap = min(self.concurrency.cap, pacing)
        if self.flow.batch_groups is None:
            reason = self.admission.wait_reason(allowance, self.released(tokens_consumed), cap)
        else:  # a batch of whole groups: the ones sent and those still generating or scoring make it up
            full = self.batch_groups_sent() + self.admission.inflight_groups >= self.flow.batch_groups
            reason = "backpressure" if full else self.admission.concurrency_reason(cap)
        if reason == "concurrency" and pacing < self.concurrency.cap:
            return "staleness pacing"  # finished groups came back too late: fewer rollouts in flight
        if reason is None and scoring_full:
            return "scoring (rollout.score_queue_maxsize groups wait to be scored)"
        return reason

    def closes_batch(self, reason: str | None) -> bool:
        """Synchronous mode closes its batch where the allowance is reached, instead of waiting for room."""
        return reason == "backpressure" and self.flow.synchronous

    def batch_has_room(self, allowance: int) -> bool:
        """After the batch's groups finished: dropped groups may have left room for more under the same weights."""
        if self.flow.batch_groups is not None:
            return self.batch_groups_sent() < self.flow.batch_groups
        return self.admission.queued_tokens(self.batch_start_tokens) < allowance

    def batch_groups_sent(self) -> int:
        """Synchronous mode: the groups of the current batch sent to the trainer."""
        return self.admission.groups_sent - self.batch_start_groups

    def start_batch(self) -> None:
        """The weights moved after a synchronous batch: the next one starts from the tokens pushed so far."""
        self.batch_start_tokens = self.admission.tokens_pushed
        self.batch_start_groups = self.admission.groups_sent

    def on_group_queued(self, start_version: int, version: int) -> bool | None:
        """Feed a group's lag to the pacer before its samples join the queue; whether it was late (None when
        nothing is paced)."""
        if self.pacer is None:
            return None
        inflight, completed = self.rollout_counts()
        return self.pacer.on_group_done(start_version, version, inflight, completed)

    def rollout_counts(self) -> tuple[int, int]:
        """(rollouts in flight, rollouts completed so far), for the caps."""
        return self.admission.inflight_rollouts, self.admission.rollouts_seen
