"""Shared state between the trainer (rank 0) and the rollout worker process.

Everything here is a multiprocessing primitive from the `spawn` context, created by the trainer and
handed to the worker at spawn time. The rollout queue carries `RolloutSample`, `PromptDone` and
`EndOfBatch` items in the order the worker produced them.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

INFLIGHT_VERSIONS = 64
"""How many of the newest policy versions with groups generating are published (``inflight_at``); an older one
is past any staleness bound the trainer checks."""


@dataclass(frozen=True)
class PromptDone:
    """A prompt that produced no sample (filtered, or its group dropped): it still counts as consumed."""

    prompt_index: int
    reason: str
    """filtered | zero_std | too_few_scorable | failed | prompt_too_long"""
    rewards: tuple[str, ...] = ()
    """The reward sources that left the group without signal (constant, or None for its rollouts)."""
    detail: str = ""
    """What happened, for the error that stops a run whose groups all drop (trainer/group_watch.py)."""


@dataclass
class WorkerChannels:
    rollout_queue: Any  # mp.Queue of RolloutSample | PromptDone | EndOfBatch
    metrics_queue: Any  # mp.Queue of dict[str, list[float]]
    exception_queue: Any  # mp.Queue of (one-line summary, formatted traceback)
    failed_event: Any  # mp.Event
    stop_event: Any  # mp.Event
    model_version: Any  # mp.Value('q'): weight syncs done
    token_allowance: Any  # mp.Value('q'): tokens the worker may hold queued or in flight
    tokens_consumed: Any  # mp.Value('q'): sample tokens the trainer pulled so far (trained or dropped)
    inflight_groups: Any  # mp.Array('q'): (version, groups generating under it) pairs, newest first, 0-padded
    items_sent: Any  # mp.Value('q'): items the worker has put on the rollout queue
    heartbeat: Any  # mp.Value('d'): time.time() of the worker's last progress
    status: Any  # mp.Array('c'): what the worker is doing or waiting on, for error messages
    spec_queue: Any  # mp.Queue of the one WorkerSpec: the worker process starts before its spec is known

    @classmethod
    def create(cls, initial_allowance: int) -> WorkerChannels:
        ctx = mp.get_context("spawn")
        return cls(
            rollout_queue=ctx.Queue(),
            metrics_queue=ctx.Queue(),
            exception_queue=ctx.Queue(),
            failed_event=ctx.Event(),
            stop_event=ctx.Event(),
            model_version=ctx.Value("q", 0),
            token_allowance=ctx.Value("q", int(initial_allowance)),
            tokens_consumed=ctx.Value("q", 0),
            inflight_groups=ctx.Array("q", 2 * INFLIGHT_VERSIONS),
            items_sent=ctx.Value("q", 0),
            heartbeat=ctx.Value("d", time.time()),
            status=ctx.Array("c", 256),
            spec_queue=ctx.Queue(),
        )

    def send(self, item: Any) -> None:
        """The worker: put an item on the rollout queue and count it (the trainer knows what is still in transit:
        ``put`` returns before a feeder thread writes the item to the pipe)."""
        self.rollout_queue.put(item)
        with self.items_sent.get_lock():
            self.items_sent.value += 1

    def publish_inflight(self, groups: Mapping[int, int]) -> None:
        """The worker: how many groups generate under each policy version (the newest INFLIGHT_VERSIONS)."""
        newest = sorted(((v, n) for v, n in groups.items() if n > 0), reverse=True)[:INFLIGHT_VERSIONS]
        flat = [x for pair in newest for x in pair]
        with self.inflight_groups.get_lock():
            self.inflight_groups[:] = flat + [0] * (len(self.inflight_groups) - len(flat))

    def inflight_at(self, version: int) -> int:
        """The trainer: groups still generating under ``version``."""
        with self.inflight_groups.get_lock():
            flat = self.inflight_groups[:]
        return next((n for v, n in zip(flat[::2], flat[1::2], strict=True) if n and v == version), 0)

    def beat(self, status: str | None = None) -> None:
        self.heartbeat.value = time.time()
        if status is not None:
            self.set_status(status)

    def set_status(self, status: str) -> None:
        self.status.value = status.encode()[:255]

    def get_status(self) -> str:
        return self.status.value.decode(errors="replace")
