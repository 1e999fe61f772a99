"""The health watchdog: a generation server that hangs (SIGSTOP, a deadlock) still accepts TCP connections, so
neither its process nor a /health probe with a short timeout says it is gone, and the worker's client retries
for minutes. The watchdog asks each server's /health in the background, one probe at a time and at most one every
``interval_s``; each probe waits up to ``server.health_timeout`` for its answer, so a slow answer that comes is
fine. A server that gave no good answer to any probe for the whole window raises what a dead one raises.

``ServerWatch`` joins it to the check for a dead server. The trainer checks while it waits for rollouts and while
it waits for a weight sync's calls (its control group checks between short waits for each answer:
asyncrl/control_group.py), so a server that hangs mid-sync ends the run after ``server.health_timeout``, not after
the call's own ``server.timeout``; a sync call that takes long while /health answers is waited for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from asyncrl.serving.handle import check_alive
from asyncrl.serving.process import ServerStartError

PROBE_INTERVAL_S = 5.0


def health_answered(base_url: str, timeout_s: float) -> bool:
    """One /health probe: True when the server answered 200 within ``timeout_s``."""
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except httpx.TransportError:
        return False


def in_thread(probe: Callable[[], None]) -> None:
    """Run ``probe`` in a daemon thread: the trainer never waits on a hung server's socket."""
    threading.Thread(target=probe, name="health-probe", daemon=True).start()


@dataclass
class _Watch:
    """One server's probes. ``silent_since``: when the first probe without a good answer since the last good one
    went out (None: the last answer was good); ``heard_until``: how far the probes have covered that silence (now,
    while one waits; its end, once it failed); ``sent_at``: when the newest probe went out."""

    base_url: str
    silent_since: float | None = None
    heard_until: float = 0.0
    sent_at: float | None = None
    in_flight: bool = False

    def silent_s(self, now: float) -> float:
        """Seconds of silence the probes witnessed: a stretch with no probe asking is not silence."""
        if self.silent_since is None:
            return 0.0
        return (now if self.in_flight else self.heard_until) - self.silent_since


class HealthWatchdog:
    """``check(during)`` (between the trainer's waits) raises ServerStartError once a server has given no good
    /health answer for more than ``timeout_s``, naming it by ``describe(index)`` (ServerGroup.describe: its
    replica, address, backend and pid) and saying what the trainer was waiting for. Silence counts only while a
    probe asks: a trainer busy for minutes between checks does not make a server silent. Checks may come from
    several threads (a sync's calls wait on threads of their own). ``clock``, ``probe`` and ``spawn`` are
    injectable for the timing logic's tests."""

    def __init__(
        self,
        base_urls: list[str],
        timeout_s: float,
        describe: Callable[[int], str],
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[str, float], bool] = health_answered,
        spawn: Callable[[Callable[[], None]], None] = in_thread,
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.timeout_s, self.describe, self.clock, self.probe, self.spawn = timeout_s, describe, clock, probe, spawn
        self.interval_s = min(interval_s, timeout_s)
        self.watches = [_Watch(url.rstrip("/")) for url in base_urls]
        self._lock = threading.Lock()

    def check(self, during: str) -> None:
        """Raise for a server silent for the whole window (``during``: what the trainer waited for, e.g. "during a
        weight sync"); else send each idle server its next probe when due."""
        with self._lock:
            now = self.clock()
            for index, watch in enumerate(self.watches):
                if watch.silent_s(now) >= self.timeout_s:
                    raise ServerStartError(
                        f"{self.describe(index)} stopped answering /health for {self.timeout_s:g} s "
                        f"(server.health_timeout) {during}: it hangs; raise server.health_timeout if it is only slow"
                    )
                if not watch.in_flight and (watch.sent_at is None or now - watch.sent_at >= self.interval_s):
                    self._send(watch, now)

    def _send(self, watch: _Watch, now: float) -> None:
        """Probe in the background; a gap since the last failed probe longer than twice the interval (the trainer
        was busy) starts the silence afresh."""
        if watch.silent_since is None or now - watch.heard_until > 2 * self.interval_s:
            watch.silent_since = now
        watch.in_flight, watch.sent_at = True, now

        def probe() -> None:
            good = self.probe(watch.base_url, self.timeout_s)
            watch.heard_until = self.clock()
            if good:
                watch.silent_since = None
            watch.in_flight = False

        self.spawn(probe)


class ServerWatch:
    """Whether the run's servers (a ServerGroup) still serve: ``check(during)`` raises ServerStartError for one that
    died (``check_alive``: how it ended, and its log) or hangs (its HealthWatchdog; none with
    server.health_timeout=null). The trainer checks while it waits for rollouts, and its control group while a
    weight sync's calls wait."""

    def __init__(self, server: Any, health_timeout_s: float | None) -> None:
        self.server, timeout_s = server, health_timeout_s
        self.watchdog = None if timeout_s is None else HealthWatchdog(server.base_urls, timeout_s, server.describe)

    def check(self, during: str) -> None:
        """Raise for a dead server, or one silent on /health for server.health_timeout ``during`` this wait."""
        check_alive(self.server)
        if self.watchdog is not None:
            self.watchdog.check(during)
