"""The health watchdog: a server that answers /health slowly lives, one silent for server.health_timeout is dead
(the timing on an injected clock, probes run when the test says they answered); and a real built-in server stopped
by SIGSTOP, which still accepts connections, is found out."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import pytest

from asyncrl.serving.process import ServerProcess, ServerStartError
from asyncrl.serving.watchdog import HealthWatchdog

WAITING = "while the trainer waited for rollouts"


class Probes:
    """An injected clock and probes that answer when the test says: ``pending`` holds the probes sent."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: list[Callable[[], None]] = []
        self.answers = True

    def watchdog(self, timeout_s: float, urls: tuple[str, ...] = ("http://a",)) -> HealthWatchdog:
        return HealthWatchdog(list(urls), timeout_s, lambda index: f"server {index}", clock=lambda: self.now,
                              probe=lambda url, t: self.answers, spawn=self.pending.append, interval_s=5.0)  # fmt: skip

    def answer_all(self) -> None:
        while self.pending:
            self.pending.pop()()


def test_a_server_that_answers_slowly_is_not_declared_dead():
    probes = Probes()
    watchdog = probes.watchdog(timeout_s=120)
    for _ in range(5):  # each answer comes 100 s after its probe: slow, never silent for the window
        watchdog.check(WAITING)
        assert len(probes.pending) == 1
        probes.now += 100
        watchdog.check(WAITING)  # the probe still waits: no second one
        assert len(probes.pending) == 1
        probes.answer_all()
    watchdog.check(WAITING)


def test_a_server_silent_for_the_window_is_dead_and_the_message_names_the_key():
    probes = Probes()
    watchdog = probes.watchdog(timeout_s=120)
    watchdog.check(WAITING)
    probes.now = 119
    watchdog.check(WAITING)
    probes.now = 121
    with pytest.raises(ServerStartError) as raised:
        watchdog.check(WAITING)
    assert str(raised.value) == (
        "server 0 stopped answering /health for 120 s (server.health_timeout) while the trainer waited for rollouts: "
        "it hangs; raise server.health_timeout if it is only slow"
    )


def test_failed_probes_add_up_but_a_gap_with_no_probe_is_not_silence():
    probes = Probes()
    probes.answers = False
    watchdog = probes.watchdog(timeout_s=20)
    watchdog.check(WAITING)
    probes.answer_all()  # refused at once
    probes.now = 300  # the trainer trained for minutes without checking: nobody asked meanwhile
    watchdog.check(WAITING)
    for _ in range(4):
        probes.answer_all()
        probes.now += 5
        watchdog.check(WAITING)
    probes.answer_all()
    probes.now += 5
    with pytest.raises(ServerStartError, match="server.health_timeout"):
        watchdog.check(WAITING)


def test_a_silent_replica_is_named():
    probes = Probes()
    watchdog = probes.watchdog(timeout_s=10, urls=("http://a", "http://b/"))
    watchdog.check(WAITING)
    probes.pending.pop(0)()  # replica 0 answers, replica 1 never does
    probes.now = 11
    with pytest.raises(ServerStartError, match=r"^server 1 stopped answering"):
        watchdog.check(WAITING)


def test_a_real_server_stopped_by_sigstop_is_found_out(tiny_server: ServerProcess):
    assert tiny_server.proc is not None
    watchdog = HealthWatchdog([tiny_server.base_url], 1.0, lambda index: tiny_server.describe(), interval_s=0.1)
    watchdog.check(WAITING)
    os.kill(tiny_server.proc.pid, signal.SIGSTOP)
    named = f"the generation server at {tiny_server.base_url} (pid {tiny_server.proc.pid})"
    try:
        deadline = time.monotonic() + 30
        with pytest.raises(ServerStartError, match=rf"^{re.escape(named)} stopped answering /health for 1 s"):
            while time.monotonic() < deadline:
                watchdog.check(WAITING)
                time.sleep(0.05)
        assert tiny_server.is_alive()  # the process lives: only its silence gave it away
    finally:
        os.kill(tiny_server.proc.pid, signal.SIGCONT)
