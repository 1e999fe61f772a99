"""Fakes of asyncrl's own interfaces that make time deterministic: a clock the test moves, and a rollout queue whose
waits move that clock to the next scripted event instead of sleeping."""

from __future__ import annotations

import dataclasses
import queue
from collections import deque
from collections.abc import Callable

from asyncrl.rollout.channels import WorkerChannels


class FakeClock:
    """A ``time.monotonic`` stand-in: time passes only when the test (or a ``ScriptedQueue`` wait) moves it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedQueue:
    """The rollout queue on a fake clock. ``get(timeout)`` with nothing queued runs the scripted events due within
    the timeout (moving the clock to each), or moves the clock by the whole timeout and raises ``queue.Empty``."""

    HORIZON_S = 3600.0
    """Fake seconds of waiting on nothing scripted after which the test fails rather than spin."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.idle_since = clock.now
        self.transit_s = 0.0
        """How long a put item takes through the pipe before ``get`` can see it."""
        self.items: deque[object] = deque()
        self.events: list[tuple[float, int, Callable[[], None]]] = []

    def at(self, delay_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` once the clock is ``delay_s`` past now (as a worker would, meanwhile)."""
        self.events.append((self.clock.now + delay_s, len(self.events), action))
        self.events.sort()

    def put(self, item: object) -> None:
        if self.transit_s:
            self.at(self.transit_s, lambda: self.items.append(item))
        else:
            self.items.append(item)

    def get_nowait(self) -> object:
        if not self.items:
            raise queue.Empty
        return self.items.popleft()

    def get(self, timeout: float) -> object:
        deadline = self.clock.now + timeout
        while not self.items:
            if not self.events or self.events[0][0] > deadline:
                self.clock.now = max(self.clock.now, deadline)
                assert self.events or self.clock.now - self.idle_since < self.HORIZON_S, "waits for nothing scripted"
                raise queue.Empty
            due, _, action = self.events.pop(0)
            self.clock.now = max(self.clock.now, due)
            action()
        self.idle_since = self.clock.now
        return self.items.popleft()

    def qsize(self) -> int:
        return len(self.items)


def scripted_channels(allowance: int = 1000) -> tuple[WorkerChannels, FakeClock]:
    """Worker channels whose rollout queue is a ``ScriptedQueue``, and the clock it moves."""
    clock = FakeClock()
    return dataclasses.replace(WorkerChannels.create(allowance), rollout_queue=ScriptedQueue(clock)), clock
