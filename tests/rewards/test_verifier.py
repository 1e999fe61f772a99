"""The math-verify child processes: verdicts, reuse, the hard deadline, and no orphans."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from asyncrl.rewards import verifier
from asyncrl.rewards.verifier import VERDICTS, VerdictCache, check_answer, check_answers, close_idle


@pytest.fixture(autouse=True)
def no_remembered_verdicts():
    """Each test asks the children afresh."""
    VERDICTS.clear()
    yield
    VERDICTS.clear()


def verifier_children() -> set[int]:
    """Live verifier processes in this test run's process group, orphans (of a spawned worker) included, started
    by this pytest worker (pytest-xdist's workers share the group: each one's children inherit its worker name)."""
    worker = f"PYTEST_XDIST_WORKER={os.environ.get('PYTEST_XDIST_WORKER', '')}".encode()
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, NotADirectoryError):
            continue
        state, group = stat[0], int(stat[2])
        mine = worker in environ or (worker.endswith(b"=") and not any(e.startswith(worker) for e in environ))
        if b"asyncrl.rewards.verifier import serve" in cmdline and state != "Z" and group == os.getpgid(0) and mine:
            pids.add(int(proc.name))
    return pids


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_verdicts():
    assert check_answer(r"\frac{1}{2}", "0.5") is True
    assert check_answer(r"\frac{1}{2}", "0.6") is False
    assert check_answer(r"\frac{1}{2}", "") is False
    assert check_answer("?", "0.5") is None


def test_a_group_is_checked_in_one_request_and_its_verdicts_remembered(monkeypatch):
    pairs = [("1", "1"), ("1", "2"), ("1", "1"), ("?", "1")]
    assert check_answers(pairs) == [True, False, True, None]
    asked = []

    def ask(self, pairs, timeout_s):
        asked.append(pairs)
        return [True] * len(pairs)

    monkeypatch.setattr(verifier.VerifierProcess, "ask", ask)
    assert check_answers([("1", "2"), ("1", "1"), ("2", "2"), ("2", "2")]) == [False, True, True, True]
    assert asked == [[("2", "2")]]


def test_the_verdict_cache_forgets_the_least_recently_used():
    cache = VerdictCache(2)
    cache.put(("a", "a", 1), True)
    cache.put(("b", "b", 1), False)
    assert cache.get(("a", "a", 1)) == (True, True)
    cache.put(("c", "c", 1), None)
    assert cache.get(("b", "b", 1)) == (False, None)
    assert cache.get(("a", "a", 1)) == (True, True) and cache.get(("c", "c", 1)) == (True, None)


def test_a_group_whose_child_misses_the_deadline_is_asked_one_answer_at_a_time(monkeypatch):
    check_answer("3", "3")
    stuck = verifier.idle[-1]  # the next call takes the most recently returned child
    os.kill(stuck.process.pid, signal.SIGSTOP)
    deadlines = iter([0.5])  # the stopped child's; fresh children get the real one (a loaded machine is slow)
    real = verifier.deadline_s
    monkeypatch.setattr(verifier, "deadline_s", lambda timeout_s: next(deadlines, None) or real(timeout_s))
    assert check_answers([("4", "4"), ("4", "5")], timeout_s=1) == [True, False]
    assert stuck.process.poll() is not None


def test_reuses_an_idle_child():
    check_answer("1", "1")
    (pid,) = [child.process.pid for child in verifier.idle[-1:]]
    check_answer("2", "2")
    assert verifier.idle[-1].process.pid == pid


def test_a_child_that_misses_the_deadline_is_killed_and_replaced(monkeypatch):
    monkeypatch.setattr(verifier, "deadline_s", lambda timeout_s: 0.5)
    check_answer("1", "1")
    stuck = verifier.idle[-1]  # the next call takes the most recently returned child
    os.kill(stuck.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    assert check_answer("1", "1", timeout_s=1) is False
    assert time.monotonic() - started < 5
    assert stuck.process.poll() is not None
    monkeypatch.undo()  # the replacement's first verdict gets the real deadline (a fresh child on a loaded machine)
    assert check_answer("6", "6") is True


def test_children_exit_when_closed_and_none_is_orphaned():
    check_answer("1", "1")
    mine = {child.process.pid for child in verifier.idle}
    assert mine <= verifier_children()
    close_idle()
    assert not verifier.idle
    assert wait_until(lambda: not verifier_children()), f"verifier processes left: {verifier_children()}"


def test_a_child_that_died_while_idle_is_replaced():
    check_answer("1", "1")
    dead = verifier.idle[-1]
    dead.process.kill()
    dead.process.wait()
    assert check_answer("5", "5") is True
    assert dead not in verifier.idle
