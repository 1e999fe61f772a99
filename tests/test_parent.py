"""Children never outlive their parent: the watcher thread ends one whose parent died, whatever its main thread
does."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def test_a_child_whose_parent_died_leaves_even_when_its_main_thread_is_stuck():
    """As a trainer rank inside a collective, where its SIGTERM handler never runs."""
    rank = ("import os, sys, time; from asyncrl.parent import exit_with_parent; "
            "exit_with_parent(os.getppid(), grace_s=0.2); print(os.getpid(), flush=True); time.sleep(120)")  # fmt: skip
    cli = (f"import subprocess, sys; rank = subprocess.Popen([sys.executable, '-c', {rank!r}], "
           "stdout=subprocess.PIPE, text=True); print(rank.stdout.readline().strip(), flush=True)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", cli], capture_output=True, text=True, timeout=120)
    pid = int(done.stdout)  # the CLI has exited; its rank is an orphan now
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
