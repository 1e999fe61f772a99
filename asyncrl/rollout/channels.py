"""Shared state between the trainer (rank 0) and the rollout worker process.

Everything here is a multiprocessing primitive from the `spawn` context, created by the trainer and
handed to the worker at spawn time. The rollout queue carries `RolloutSample`, `PromptDone` and
`EndOfBatch` items in the order the worker produced them.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

NONE_INFLIGHT = 1 << 62
"""``oldest_inflight_version`` when no group is generating."""


@dataclass(frozen=True)
class PromptDone:
    """A prompt that produced no sample (filtered, or its group dropped): it still counts as consumed."""

    prompt_index: int
    reason: str


@dataclass
class WorkerChannels:
    rollout_queue: Any  # mp.Queue of RolloutSample | PromptDone | EndOfBatch
    metrics_queue: Any  # mp.Queue of dict[str, list[float]]
    exception_queue: Any  # mp.Queue of str (formatted traceback)
    failed_event: Any  # mp.Event
    stop_event: Any  # mp.Event
    model_version: Any  # mp.Value('q'): weight syncs done
    token_allowance: Any  # mp.Value('q'): tokens the worker may hold queued or in flight
    tokens_consumed: Any  # mp.Value('q'): sample tokens the trainer pulled so far (trained or dropped)
    oldest_inflight_version: Any  # mp.Value('q'): the oldest policy version generating now (NONE_INFLIGHT: none)
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
            oldest_inflight_version=ctx.Value("q", NONE_INFLIGHT),
            heartbeat=ctx.Value("d", time.time()),
            status=ctx.Array("c", 256),
            spec_queue=ctx.Queue(),
        )

    def beat(self, status: str | None = None) -> None:
        self.heartbeat.value = time.time()
        if status is not None:
            self.set_status(status)

    def set_status(self, status: str) -> None:
        self.status.value = status.encode()[:255]

    def get_status(self) -> str:
        return self.status.value.decode(errors="replace")
