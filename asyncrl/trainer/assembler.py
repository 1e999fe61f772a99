"""Assemble one optimizer step from the rollout queue: pull, drop stale or oversize samples, plan rows.

A step is micro-batches of ``dp`` rows, one per trainer rank, planned by the load-balancing
MicroBatchPlanner (packing/planner.py); with one rank a micro-batch is a row, closed when the next sample
does not fit. Asynchronous mode closes a step after ``gradient_accumulation_steps`` micro-batches.
With ``samples_per_step`` (trainer.samples_per_step) a step closes instead at that many samples, in as many
micro-batches as they fill: the batch size a user sets, whatever the samples' lengths (the loss is normalised over
the step's rows and ranks, trainer/distributed.py, so more rows do not change its scale).
Synchronous mode (max_staleness=0) takes everything up to the worker's ``EndOfBatch`` marker. Of the samples
that have arrived, the oldest policy version is taken first: groups finish out of their start order, and a
sample one sync from its staleness limit must not wait behind younger ones that have time to spare. For the
same reason a step waits for a group still generating at its last version (for as long as ``ExpiringWait`` in
flow.py allows), and a full step takes one more micro-batch of samples at their last version instead of
dropping them. A step never carries a sample into
the next one: that one trains after a sync, so the sample is checked again when it is pulled. While
waiting, the worker's failure, silence and the server's death are checked so a broken run fails within
seconds with the reason, never hangs.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.flow import FlowControl
from asyncrl.metrics import MetricWindow
from asyncrl.packing import MicroBatchPlanner, Row, RowFactory
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.types import EndOfBatch, PromptDone, RolloutSample
from asyncrl.trainer.group_watch import GroupWatch

IN_TRANSIT_TIMEOUT_S = 5.0
"""After waiting for expiring groups: how long the items the worker has sent may take through the queue's pipe
before the step goes on without them."""


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed, hung or died; the message says why in one line, ``details`` holds the worker's
    traceback (for the run's log)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


@dataclass
class PromptProgress:
    """Which prompts of the stream are consumed (trained or dropped); the cursor is the first that is not."""

    cursor: int
    done: set[int] = field(default_factory=set)
    consumed: int = 0

    def mark(self, prompt_index: int) -> None:
        if prompt_index < self.cursor or prompt_index in self.done:
            return
        self.done.add(prompt_index)
        self.consumed += 1
        while self.cursor in self.done:
            self.done.discard(self.cursor)
            self.cursor += 1


@dataclass
class Step:
    rows: list[Row]
    """The rows that hold samples, micro-batch by micro-batch."""
    wait_s: float
    final: bool = False
    """The worker has no more prompts: this is the last (possibly partial) step."""
    placement: list[list[int | None]] = field(default_factory=list)
    """Per micro-batch, per rank: the index in ``rows`` of that rank's row, None where the planner left it none.
    Left empty: one rank, a row per micro-batch."""

    def __post_init__(self) -> None:
        self.placement = self.placement or [[index] for index in range(len(self.rows))]

    @classmethod
    def of(cls, micro_batches: list[list[Row]], wait_s: float, final: bool = False) -> Step:
        """A step from the planner's micro-batches (one row per rank each, empty rows included)."""
        rows: list[Row] = []
        placement: list[list[int | None]] = []
        for micro in micro_batches:
            placement.append([])
            for row in micro:
                placement[-1].append(len(rows) if row.samples else None)
                if row.samples:
                    rows.append(row)
        return cls(rows, wait_s, final, placement)

    @property
    def samples(self) -> list[RolloutSample]:
        return [s for row in self.rows for s in row.samples]


class StepAssembler:
    def __init__(
        self,
        channels: WorkerChannels,
        row_factory: RowFactory,
        token_budget: int,
        micro_batches_per_step: int,
        flow: FlowControl,
        progress: PromptProgress,
        window: MetricWindow,
        health_check: Callable[[], None],
        worker_timeout_s: float,
        dp: int = 1,
        watch: GroupWatch | None = None,
        samples_per_step: int | None = None,
    ) -> None:
        self.channels, self.token_budget = channels, token_budget
        self.micro_batches_per_step, self.flow = micro_batches_per_step, flow
        self.clock, self.expiring = flow.clock, flow.expiring_wait()
        self.progress, self.window = progress, window
        self.health_check, self.worker_timeout_s = health_check, worker_timeout_s
        self.planner = MicroBatchPlanner(row_factory, dp, token_budget)
        self.watch = watch or GroupWatch(None, 1.0)
        self.samples_per_step = samples_per_step
        self._samples: list[tuple[int, int, RolloutSample]] = []  # heap by (model_version, arrival)
        self._markers: deque[PromptDone | EndOfBatch] = deque()
        self._arrivals = itertools.count()
        self._sync_follows = True
        self._received = 0  # items taken off the rollout queue (the worker counts those it sent)
        self.solved = ""
        """The worker's line when its prompts ended because every one was retired (data.retire_solved_after)."""

    @property
    def held(self) -> int:
        """Samples taken off the rollout queue and not yet pulled into a step (they count in its size)."""
        return len(self._samples)

    def next_step(self, sync_follows: bool = True) -> Step:
        """The next step's micro-batches. Nothing carries over: the sample that would open the next step's first
        micro-batch goes back among the held ones (``_opens_next_step``). ``sync_follows``: the weights move after
        this step (staleness.weight_sync_steps); if not, the next step trains at the same version, so no sample
        is at its last chance in this one."""
        # A dead worker ends the run now, samples held or not: the restart resumes from the last checkpoint, so
        # steps trained after it died would be thrown away, and generation stays down until it restarts.
        self._check_worker()
        micro_batches: list[list[Row]] = []
        wait_s, overflow, taken = 0.0, False, 0
        self.expiring.start_step()
        self._sync_follows = sync_follows
        while True:
            item, waited = self._get()
            wait_s += waited
            if isinstance(item, PromptDone):
                self.progress.mark(item.prompt_index)
                continue
            if isinstance(item, EndOfBatch):
                self._close(micro_batches, self.planner.flush())
                self.solved = item.solved
                final = not self.flow.synchronous or bool(item.solved)  # synchronous mode: the last batch's marker
                if micro_batches or final:
                    return self._step(micro_batches, wait_s, final=final, overflow=overflow)
                continue
            if self._dropped(item):
                continue
            full = self._opens_next_step(micro_batches, item, overflow)
            if full and not overflow and self._last_chance(item):
                overflow = True  # one more micro-batch, for samples that train in this step or never
            elif full or (overflow and not self._last_chance(item)):
                self._hold(item)  # checked again, at that step's version, when it is pulled
                self._close(micro_batches, self.planner.flush())
                return self._step(micro_batches, wait_s, overflow=overflow)
            self._take(item)
            self._close(micro_batches, self.planner.offer(item))
            taken += 1
            if taken == self.samples_per_step:  # a fixed number of samples, in as many rows as they filled
                self._close(micro_batches, self.planner.flush())
                return self._step(micro_batches, wait_s)

    def _step(self, micro_batches: list[list[Row]], wait_s: float, final: bool = False, overflow: bool = False) -> Step:
        if not self.flow.synchronous:
            self.window.add("sample/expiring_wait_s", self.expiring.waited_s)
            self.window.add("batch/overflow_micro_batch_count", float(overflow))
        return Step.of(micro_batches, wait_s, final)

    def _close(self, micro_batches: list[list[Row]], closed: list[Row] | None) -> bool:
        """Add a closed micro-batch to the step; its prompts count as consumed only now that they train."""
        if closed is None:
            return False
        micro_batches.append(closed)
        for row in closed:
            for sample in row.samples:
                self.progress.mark(sample.prompt_index)
        return True

    def _opens_next_step(self, micro_batches: list[list[Row]], sample: RolloutSample, overflow: bool) -> bool:
        """The sample would close the step's last micro-batch and open the next step's first. That step trains
        after the next weight sync, one version later, so the sample goes back among the held ones instead of
        waiting in a row where its staleness would no longer be checked."""
        if self.samples_per_step is not None:
            return False  # the step closes at its count of samples, however many rows they take
        last = len(micro_batches) == self.micro_batches_per_step - 1 + overflow
        return last and not self.flow.synchronous and not self.planner.fits(sample)

    def _last_chance(self, sample: RolloutSample) -> bool:
        """The sample trains in this step or is dropped by the next: a step that is full takes one more
        micro-batch of such samples rather than waste their generation (the loss is normalised per step, so a
        step of more rows is a larger batch, as a synchronous step's overshoot is)."""
        return self._sync_follows and sample.model_version <= self.flow.last_chance_version(self._version())

    def _drop_reason(self, sample: RolloutSample) -> str | None:
        """ "stale" for a sample too stale to train now, "oversize" for one too long for any row, else None."""
        if self.flow.is_stale(sample.model_version, self._version()):
            return "stale"
        return "oversize" if sample.num_tokens > self.token_budget else None

    def _dropped(self, sample: RolloutSample) -> bool:
        """Drop (and count as consumed) a sample too stale to train now or too long for any row."""
        reason = self._drop_reason(sample)
        if reason is None:
            return False
        self.window.add("sample/dropped_stale_count" if reason == "stale" else "batch/dropped_oversize_count", 1)
        self._consume(sample)
        self.progress.mark(sample.prompt_index)
        return True

    def _take(self, sample: RolloutSample) -> None:
        """Count the sample as consumed: it trains in this step, at the current version."""
        self._consume(sample)
        staleness = self._version() - sample.model_version
        self.window.add("sample/staleness_mean", staleness)
        self.window.add("sample/staleness_max", staleness)
        self.window.add("sample/time_in_queue_s", time.time() - sample.queued_at)

    def _version(self) -> int:
        """The policy version training now (weight syncs done)."""
        return self.channels.model_version

    def _consume(self, sample: RolloutSample) -> None:
        self.channels.consume(sample.num_tokens)

    def _get(self) -> tuple[object, float]:
        """The next item: a PromptDone first, then the oldest-version sample that arrived, an EndOfBatch last."""
        started = self.clock()
        waited_on_expiring = False
        while True:
            expiring = self._expiring_in_flight()
            if self._markers or (self._samples and not expiring):
                break
            waited_on_expiring |= expiring
            passed, held_back = self.clock(), expiring and bool(self._samples)
            self._receive(timeout_s=0.05 if expiring else 0.2)
            if held_back:  # samples were here to train: the time is the expiring group's
                self.expiring.held_back(passed)
        if waited_on_expiring:  # the group is done, but its last samples may still be in the queue's pipe
            self._drain_sent()
        while self._receive(timeout_s=0.0):
            pass
        if self._markers and (isinstance(self._markers[0], PromptDone) or not self._samples):
            return self._markers.popleft(), self.clock() - started
        return heapq.heappop(self._samples)[2], self.clock() - started

    def _receive(self, timeout_s: float) -> bool:
        """Hold the next item off the rollout queue (waiting up to ``timeout_s``); False if none came."""
        try:
            item = self.channels.rollout_queue.get(timeout=timeout_s) if timeout_s else \
                self.channels.rollout_queue.get_nowait()  # fmt: skip
        except queue.Empty:
            if timeout_s:
                self._check_worker()
            return False
        self._received += 1
        self._hold(item)
        self._watch(item)
        return True

    def _watch(self, item: object) -> None:
        """Each group's fate, in the order the worker sent them, to the watch that stops a run that cannot train."""
        if isinstance(item, RolloutSample):
            self.watch.on_sample(item.group_id, self._drop_reason(item), item.reward)
        elif isinstance(item, PromptDone) and item.reason not in ("filtered", "retired"):  # never generated
            self.watch.on_dropped(item.reason, item.rewards, item.detail, item.reward)

    def _drain_sent(self) -> None:
        """Receive every item the worker had sent by now (bounded by IN_TRANSIT_TIMEOUT_S)."""
        sent = self.channels.items_sent
        deadline = self.clock() + IN_TRANSIT_TIMEOUT_S
        while self._received < sent and self.clock() < deadline:
            self._receive(timeout_s=0.05)

    def _expiring_in_flight(self) -> bool:
        """Whether to wait for groups still generating whose samples train in this step or never, rather than fill
        the step with younger samples that can wait a step (at most one step's time per step). Short groups
        finish first, so without this a long group started just before a sync misses the last step it may train
        in, and its generation is wasted."""
        if self.flow.synchronous or not self._sync_follows or not self.expiring.open():
            return False
        last_chance = self.flow.last_chance_version(self._version())  # this version trains now or never
        if self._samples and self._samples[0][0] <= last_chance:
            return False  # one of them is here: take it first
        return self.channels.inflight_at(last_chance) > 0  # older groups are past saving: not waited for

    def _hold(self, item: object) -> None:
        if isinstance(item, RolloutSample):
            heapq.heappush(self._samples, (item.model_version, next(self._arrivals), item))
        elif isinstance(item, PromptDone):
            self._markers.appendleft(item)  # before any EndOfBatch held: it only moves the prompt cursor
        else:
            self._markers.append(item)

    def _check_worker(self) -> None:
        failure = self.channels.failure()
        if failure is not None:
            line, trace = failure
            raise RolloutWorkerError(f"the rollout worker failed: {line}", details=trace)
        self.health_check()
        silent_s = time.time() - self.channels.heartbeat
        if silent_s > self.worker_timeout_s:
            raise RolloutWorkerError(
                f"the rollout worker made no progress for {silent_s:.0f}s (staleness.rollout_worker_timeout="
                f"{self.worker_timeout_s:g}); it was: {self.channels.get_status() or 'starting'}"
            )
