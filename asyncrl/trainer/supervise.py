"""The CLI's side of a multi-rank run: start the trainer ranks, watch them and the server, stop them all.

Each rank is ``python -m asyncrl.trainer.rank_main RUN_DIR`` in its own session (its rollout worker with
it) that the kernel terminates if the CLI dies. When a rank fails, the server dies or the CLI is interrupted,
every rank's session is terminated, then killed after a grace period; the CLI's server context stops the
server. Rank 0 writes to the CLI's console; the other ranks to logs/rank_N.log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.parent import die_with_parent
from asyncrl.server.handle import check_alive
from asyncrl.server.process import free_port

SERVER_URL_ENV = "ASYNCRL_SERVER_URL"
GRACE_S = 10.0
POLL_S = 0.2


class TrainerRankError(RuntimeError):
    """A trainer rank exited with an error; the message names it and carries the end of its log."""


def run_ranks(run_dir: Path, world: int, server: Any) -> None:
    """Run ``world`` trainer ranks to completion; raise TrainerRankError as soon as one fails."""
    ranks = RankProcesses(run_dir, world, server.base_url)
    try:
        ranks.wait(server)
    finally:
        ranks.stop()


class RankProcesses:
    def __init__(self, run_dir: Path, world: int, server_url: str) -> None:
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            SERVER_URL_ENV: server_url,
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(world):
            out = None if rank == 0 else open(self.log_path(rank), "wb")  # noqa: SIM115 - closed with the process
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "asyncrl.trainer.rank_main", str(run_dir)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    preexec_fn=die_with_parent(),
                )
            )
            if out is not None:
                out.close()

    def log_path(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def wait(self, server: Any) -> None:
        """Until every rank exited 0; the first failure (or the server's death) raises."""
        while True:
            codes = [proc.poll() for proc in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    raise TrainerRankError(f"trainer rank {rank} exited with code {code}{self._tail(rank)}")
            if all(code == 0 for code in codes):
                return
            check_alive(server)
            time.sleep(POLL_S)

    def _tail(self, rank: int, lines: int = 30) -> str:
        if rank == 0:
            return " (its output is above)"
        text = self.log_path(rank).read_text(errors="replace").splitlines()[-lines:]
        return f"; end of {self.log_path(rank)}:\n" + "\n".join(text)

    def stop(self) -> None:
        """Terminate every rank still running (its session: the rollout worker too), then kill stragglers. A
        second Ctrl-C or SIGTERM meanwhile is ignored: it would skip the kill of a rank stuck in a collective."""
        with _signals_ignored():
            self._terminate_then_kill()

    def _terminate_then_kill(self) -> None:
        for proc in self.procs:
            _signal_session(proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_session(proc, signal.SIGKILL)
                proc.wait()
        for proc in self.procs:  # a rank that exited may have left its session's children behind
            _signal_session(proc, signal.SIGKILL)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside (main thread only: elsewhere signals cannot be set, nor arrive)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_session(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
