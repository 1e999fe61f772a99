"""Never outlive the parent: the one way every process asyncrl starts (the generation server, the trainer ranks,
the rollout worker, the math-verify children) ends when the process that started it dies, even by SIGKILL.

Two mechanisms, each for the children the other cannot cover:

- ``die_with_parent()``, a ``preexec_fn`` for ``subprocess.Popen`` (the server, the ranks): the child starts its
  own session (its children go with it) and asks the kernel for SIGTERM when the parent dies (Linux prctl
  PR_SET_PDEATHSIG). It runs between fork and exec, so the parent must start the child from its main thread
  (the kernel signals when the starting *thread* ends) and have no other threads forking meanwhile.
- ``exit_with_parent(parent_pid)``, a daemon thread in the child that ends it once its parent is gone: for a child
  that multiprocessing spawns (the worker: no preexec hook), one started from any thread (the verifier children,
  started by the worker's scoring threads), and one whose main thread may never run a SIGTERM handler (a rank
  waiting inside a collective: Python handles signals between bytecodes, in the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
ORPHANED_EXIT = 3
POLL_S = 0.5
"""How often the watcher thread looks at its parent: the kernel has no notification that reaches a thread."""


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: in the child, before exec, start a session and ask the kernel for SIGTERM when the
    parent dies; a parent already gone by then (it died between fork and the request) ends the child at once."""
    parent = os.getpid()

    def in_child() -> None:
        os.setsid()
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return in_child


def exit_with_parent(parent_pid: int, *, grace_s: float = 0.0, message: str = "") -> threading.Thread:
    """Start a daemon thread that ends this process with ORPHANED_EXIT, ``grace_s`` after ``parent_pid`` is no
    longer its parent (time for a SIGTERM handler to end it cleanly first), printing ``message`` to stderr if
    given."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        time.sleep(grace_s)
        if message:
            print(message, file=sys.stderr, flush=True)
        os._exit(ORPHANED_EXIT)

    thread = threading.Thread(target=watch, name="asyncrl-exit-with-parent", daemon=True)
    thread.start()
    return thread
