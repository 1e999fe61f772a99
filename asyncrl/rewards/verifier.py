"""math-verify in child processes, so that a comparison which hangs can be stopped from any thread.

math-verify bounds its work with SIGALRM, which only the main thread can use, and the rollout worker scores
from threads; with its timeouts off, ``verify`` on an answer like ``9^{9^{9^9}}`` runs for minutes. Each child
runs math-verify on its own main thread with those timeouts on, the caller adds a hard deadline and kills a
child that misses it, and a child exits when its stdin closes or its parent is gone (``exit_with_parent``: a
verdict that runs on cannot keep it alive), so it cannot outlive its parent.

A group's answers go to one child in one request, and verdicts are remembered (``VERDICTS``): near convergence a
run sees the same few answers to each prompt over and over, and the rollout worker, whose one event loop also
streams every completion, then scores hundreds of groups a second. A round trip per answer, each a thread waking
for the GIL against that busy loop, made scoring what bounded the run (benchmarks/RESULTS.md, session 35).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence

from asyncrl.parent import exit_with_parent

STARTUP_TIMEOUT_S = 120.0
logger = logging.getLogger(__name__)


def judge(gold: str, answer: str, timeout_s: int) -> bool | None:
    """None if math-verify cannot parse ``gold``; else whether ``answer`` parses and equals it."""
    from math_verify import verify

    gold_parsed = parse_boxed(gold, timeout_s)
    if not gold_parsed:
        return None
    answer_parsed = parse_boxed(answer, timeout_s)
    return bool(answer_parsed) and verify(gold_parsed, answer_parsed, timeout_seconds=timeout_s)


@functools.lru_cache(maxsize=4096)
def parse_boxed(text: str, timeout_s: int) -> list:
    """Parse ``text`` as a boxed LaTeX answer (cached: a group's rollouts share one gold)."""
    from math_verify import LatexExtractionConfig, parse

    if not text.strip():
        return []
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return parse(f"\\boxed{{{text}}}", extraction_config=config, fallback_mode="no_fallback", parsing_timeout=timeout_s)


def serve() -> None:
    """Child loop: one JSON ``[[[gold, answer], ...], timeout_s]`` per stdin line -> one JSON line of verdicts. It
    ends when its parent closes stdin; a terminal's Ctrl-C, which reaches it too, is ignored (no traceback per
    child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(os.getppid())
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints from sympy must not corrupt the replies
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (import before "ready", so the first request pays no import time)

    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        pairs, timeout_s = json.loads(line)
        replies.write(json.dumps([judge(gold, answer, timeout_s) for gold, answer in pairs]) + "\n")
        replies.flush()


class VerifierProcess:
    """One child running ``serve``; used by one caller at a time."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        code = "from asyncrl.rewards.verifier import serve; serve()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        if self.read_line(STARTUP_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError(f"math-verify child process (pid {self.process.pid}) did not start")

    def read_line(self, timeout_s: float) -> str | None:
        """The child's next full line, or None if it gives none within ``timeout_s`` or has exited."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        return line.strip() if line.endswith("\n") else None

    def ask(self, pairs: Sequence[tuple[str, str]], timeout_s: int) -> list[bool | None] | None:
        """The verdicts on ``pairs`` (gold, answer), or None if the child gives none within their deadline."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps([list(pairs), timeout_s]) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        reply = self.read_line(len(pairs) * deadline_s(timeout_s))
        return None if reply is None else json.loads(reply)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def deadline_s(timeout_s: int) -> float:
    """How long the caller waits for a verdict: parsing gold, parsing the answer and verifying are each bounded
    by ``timeout_s`` inside the child, plus slack for scheduling."""
    return 3 * timeout_s + 2.0


idle: list[VerifierProcess] = []
idle_lock = threading.Lock()


def take_idle() -> VerifierProcess | None:
    """An idle child that is still alive, closing any that died while idle (e.g. out of memory)."""
    while True:
        with idle_lock:
            child = idle.pop() if idle else None
        if child is None or child.process.poll() is None:
            return child
        child.close()


class VerdictCache:
    """The last ``size`` verdicts, by (gold, answer, timeout_s); shared by the threads that score."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.verdicts: OrderedDict[tuple[str, str, int], bool | None] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple[str, str, int]) -> tuple[bool, bool | None]:
        """(found, verdict)."""
        with self.lock:
            if key not in self.verdicts:
                return False, None
            self.verdicts.move_to_end(key)
            return True, self.verdicts[key]

    def put(self, key: tuple[str, str, int], verdict: bool | None) -> None:
        with self.lock:
            self.verdicts[key] = verdict
            self.verdicts.move_to_end(key)
            if len(self.verdicts) > self.size:
                self.verdicts.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.verdicts.clear()


VERDICTS = VerdictCache(65536)
"""A verdict that ran out of time is remembered as False too: the same answer would only run out again."""


def check_answer(gold: str, answer: str, timeout_s: float = 5) -> bool | None:
    """None if ``gold`` is unparsable; False if ``answer`` is unparsable, wrong or takes too long; else True."""
    return check_answers([(gold, answer)], timeout_s)[0]


def check_answers(pairs: Sequence[tuple[str, str]], timeout_s: float = 5) -> list[bool | None]:
    """``check_answer`` on each (gold, answer): remembered verdicts, then the rest in one request to one child."""
    timeout_s = max(1, math.ceil(timeout_s))  # SIGALRM counts whole seconds
    found = {pair: VERDICTS.get((*pair, timeout_s)) for pair in dict.fromkeys(pairs)}
    missing = [pair for pair, (hit, _) in found.items() if not hit]
    verdicts = {pair: verdict for pair, (hit, verdict) in found.items() if hit}
    if missing:
        verdicts |= dict(zip(missing, _ask_child(missing, timeout_s), strict=True))
    for pair in missing:
        VERDICTS.put((*pair, timeout_s), verdicts[pair])
    return [verdicts[pair] for pair in pairs]


def _ask_child(pairs: list[tuple[str, str]], timeout_s: int) -> list[bool | None]:
    """One child's verdicts on ``pairs``. A child that misses the deadline is killed, and the pairs are asked one at
    a time (each of a new child's), so that the answer which hangs scores False and costs no other its verdict."""
    child = take_idle() or VerifierProcess()
    verdicts = child.ask(pairs, timeout_s)
    if verdicts is None or len(verdicts) != len(pairs):
        child.close()
        if len(pairs) > 1:
            return [_ask_child([pair], timeout_s)[0] for pair in pairs]
        logger.warning("math-verify gave no verdict on answer %.80r (gold %.80r) in time; child replaced", pairs[0][1],
                       pairs[0][0])  # fmt: skip
        return [False]
    with idle_lock:
        idle.append(child)
    return verdicts


@atexit.register
def close_idle() -> None:
    """Stop every idle child (busy ones exit when this process does, as their stdin closes)."""
    with idle_lock:
        children, idle[:] = list(idle), []
    for child in children:
        child.close()


# A forked process must not share its parent's children (their pipes belong to the parent).
os.register_at_fork(after_in_child=idle.clear)
