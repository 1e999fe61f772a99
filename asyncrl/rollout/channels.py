"""The channels between the trainer (rank 0) and its rollout worker process: seven shared primitives.

Created by the trainer from the ``spawn`` context and handed to the worker at spawn time. Each carries what no
other can:

1. ``rollout_queue`` (worker -> trainer): ``RolloutSample``, ``PromptDone`` and ``EndOfBatch`` items in the order
   the worker produced them: the data.
2. ``metrics_queue`` (worker -> trainer): the worker's metric buffers, about once a second; apart from the data,
   which the trainer reads by the sample, these it reads at its logging steps.
3. ``failure_queue`` (worker -> trainer): the failed worker's one-line summary and traceback; apart from the data
   so that the trainer sees it at once, whatever samples still wait ahead of it.
4. ``control_queue`` (trainer -> worker): the ``WorkerSpec`` (the worker process starts before the spec exists),
   then a stop request; a thread of the worker blocks on it, so a stop wakes the worker at once.
5. ``trainer_counters`` (written by the trainer only): weight syncs done, the token allowance and the sample tokens
   consumed, which the worker's admission reads whenever it decides.
6. ``worker_counters`` (written by the worker only): the items it sent (the trainer knows what is still in the
   queue's pipe), its heartbeat, and how many groups generate under each recent policy version (the trainer waits
   for a group that must train in its next step).
7. ``status``: what the worker is doing or waiting on, for the trainer's error messages.

The counters are arrays rather than one value each: every field of one array has a single writer, so one lock
covers them and nothing is lost by sharing it. Readers and writers alike wait at most LOCK_WAIT_S for that lock
(``_locked``): a process killed while holding it (the worker's kill -9 in a chaos run) leaves it held for good,
since POSIX semaphores are not robust, and a process blocked on it would never get to check whether the other
lives. That holds for writes too: the worker takes the trainer's counters' lock to read them, and a worker killed
there left the trainer's next ``model_version`` write blocked for good (CI, session 25: a chaos run's worker kill
unnoticed for 5 minutes). Without the lock a single writer's field is still whole: each is one aligned 8-byte word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import queue
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

INFLIGHT_VERSIONS = 64
"""How many of the newest policy versions with groups generating are published (``inflight_at``); an older one
is past any staleness bound the trainer checks."""

STOP = "stop"
"""The trainer's stop request on the control queue."""

LOCK_WAIT_S = 1.0
"""How long a reader waits for a shared array's lock before reading without it: no live writer holds it that long,
and what a dead one left is final."""

_VERSION, _ALLOWANCE, _CONSUMED = range(3)  # trainer_counters
_SENT, _HEARTBEAT_MS, _INFLIGHT = range(3)  # worker_counters; (version, groups) pairs from _INFLIGHT on


class _Cell:
    """One field of a counter array, read and written as an int attribute of the channels."""

    def __init__(self, array: str, index: int) -> None:
        self.array, self.index = array, index

    def __get__(self, channels: WorkerChannels, owner: type) -> int:
        return int(_read(getattr(channels, self.array), lambda raw: raw[self.index]))

    def __set__(self, channels: WorkerChannels, value: int) -> None:
        with _locked(getattr(channels, self.array)) as raw:
            raw[self.index] = value


@contextlib.contextmanager
def _locked(array: Any) -> Iterator[Any]:
    """A shared array's raw object under its lock, or without it once LOCK_WAIT_S passed (its holder died: see the
    module docstring)."""
    lock = array.get_lock()
    held = lock.acquire(timeout=LOCK_WAIT_S)
    try:
        yield array.get_obj()
    finally:
        if held:
            lock.release()


def _read(array: Any, read: Any) -> Any:
    """``read(raw)`` of a shared array (``_locked``)."""
    with _locked(array) as raw:
        return read(raw)


@dataclass
class WorkerChannels:
    rollout_queue: Any  # mp.Queue of RolloutSample | PromptDone | EndOfBatch
    metrics_queue: Any  # mp.Queue of dict[str, list[float]]
    failure_queue: Any  # mp.Queue of (one-line summary, formatted traceback)
    control_queue: Any  # mp.Queue of the one WorkerSpec, then STOP
    trainer_counters: Any  # mp.Array('q', 3): model version, token allowance, tokens consumed
    worker_counters: Any  # mp.Array('q'): items sent, heartbeat (ms since the epoch), (version, groups) pairs
    status: Any  # mp.Array('c', 256)
    _failure: tuple[str, str] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def create(cls, initial_allowance: int, in_process: bool = False) -> WorkerChannels:
        """The channels for a spawned worker; ``in_process``: for a worker driven in this process (tests), with
        plain queues that hand items over at once."""
        ctx = mp.get_context("spawn")
        make_queue = LocalQueue if in_process else ctx.Queue
        channels = cls(
            rollout_queue=make_queue(),
            metrics_queue=make_queue(),
            failure_queue=make_queue(),
            control_queue=make_queue(),
            trainer_counters=ctx.Array("q", 3),
            worker_counters=ctx.Array("q", _INFLIGHT + 2 * INFLIGHT_VERSIONS),
            status=ctx.Array("c", 256),
        )
        channels.token_allowance = int(initial_allowance)
        channels.heartbeat = time.time()
        return channels

    # ---- written by the trainer ------------------------------------------------------------------------------

    model_version = _Cell("trainer_counters", _VERSION)  # weight syncs done
    token_allowance = _Cell("trainer_counters", _ALLOWANCE)  # tokens the worker may hold queued or in flight
    tokens_consumed = _Cell("trainer_counters", _CONSUMED)  # sample tokens pulled so far (trained or dropped)

    def consume(self, tokens: int) -> None:
        with _locked(self.trainer_counters) as raw:
            raw[_CONSUMED] += tokens

    def send_spec(self, spec: object) -> None:
        """Give the worker its work; its silence counts from now (the trainer's warm-up and the server's boot
        before it can take many minutes, all of it waiting on neither the worker nor its server)."""
        self.heartbeat = time.time()
        self.control_queue.put(spec)

    def stop(self) -> None:
        """Ask the worker to end now, rollouts in flight included (or, before its spec, to end without one)."""
        self.control_queue.put(STOP)

    def failure(self) -> tuple[str, str] | None:
        """The worker's (summary, traceback) once it has failed; kept, so every later call says so too."""
        if self._failure is None:
            try:
                self._failure = self.failure_queue.get_nowait()
            except queue.Empty:
                pass
        return self._failure

    def inflight_at(self, version: int) -> int:
        """Groups still generating under ``version``."""
        flat = _read(self.worker_counters, lambda raw: raw[_INFLIGHT:])
        return next((n for v, n in zip(flat[::2], flat[1::2], strict=True) if n and v == version), 0)

    items_sent = _Cell("worker_counters", _SENT)

    @property
    def heartbeat(self) -> float:
        """time.time() of the worker's last progress."""
        return float(_read(self.worker_counters, lambda raw: raw[_HEARTBEAT_MS])) / 1000

    @heartbeat.setter
    def heartbeat(self, seconds: float) -> None:
        with _locked(self.worker_counters) as raw:
            raw[_HEARTBEAT_MS] = int(seconds * 1000)

    def get_status(self) -> str:
        return bytes(_read(self.status, lambda raw: raw.value)).decode(errors="replace")

    # ---- written by the worker -------------------------------------------------------------------------------

    def send(self, item: Any) -> None:
        """Put an item on the rollout queue and count it (the trainer knows what is still in transit: ``put``
        returns before a feeder thread writes the item to the pipe)."""
        self.rollout_queue.put(item)
        with _locked(self.worker_counters) as raw:
            raw[_SENT] += 1

    def publish_inflight(self, groups: Mapping[int, int]) -> None:
        """How many groups generate under each policy version (the newest INFLIGHT_VERSIONS)."""
        newest = sorted(((v, n) for v, n in groups.items() if n > 0), reverse=True)[:INFLIGHT_VERSIONS]
        flat = [x for pair in newest for x in pair]
        with _locked(self.worker_counters) as raw:
            raw[_INFLIGHT:] = flat + [0] * (2 * INFLIGHT_VERSIONS - len(flat))

    def beat(self, status: str | None = None) -> None:
        self.heartbeat = time.time()
        if status is not None:
            self.set_status(status)

    def set_status(self, status: str) -> None:
        with _locked(self.status) as raw:
            raw.value = status.encode()[:255]

    def report_failure(self, line: str, trace: str) -> None:
        self.failure_queue.put((line, trace))

    def abandon(self) -> None:
        """Stopping: exit without waiting for the items nobody will read to be flushed to the trainer."""
        self.rollout_queue.cancel_join_thread()
        self.metrics_queue.cancel_join_thread()


class LocalQueue(queue.Queue):
    """A queue within one process, with the part of the multiprocessing queue's interface the channels use."""

    def cancel_join_thread(self) -> None:
        """No feeder thread to wait for."""
