"""The trainer's ranks, started by torch's own launcher: the CLI's side, and the launcher's process.

``asyncrl train`` with several ranks runs ``python -m asyncrl.trainer.launcher RUN_DIR``: torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs) starting this node's ranks, each
``python -m asyncrl.trainer.rank_main RUN_DIR``, at a c10d rendezvous (trainer.rdzv_endpoint, else a free loopback
port). Other nodes run that same rank command under their own ``torchrun --rdzv-backend c10d`` at that endpoint:
one rendezvous, one entry point, whichever launched it.

Why the agent runs in a child process rather than in the CLI: ``elastic_launch`` blocks until the ranks end and,
in the main thread, installs SIGINT/SIGTERM handlers that raise inside its monitor loop and are never restored.
From a child, the CLI keeps its own signal handling and its loop that watches the generation server, and stops
the ranks with one SIGTERM to the agent, whose handler is torch's own shutdown: SIGTERM to each rank's session
(its rollout worker with it), SIGKILL after SHUTDOWN_S. The agent ends with the CLI (die-with-parent), the ranks
with the agent (``exit_with_parent`` in rank_main), so a CLI killed outright leaves no process behind either.

Failures: a rank that fails records its exception in its error file (torch's ``record``/error-file protocol);
the agent stops every rank of its node and records the first failure, naming the rank, in its own error file,
from which the CLI raises TrainerRankError. Across nodes, torch's agents stop their ranks when the rendezvous
store (hosted by the agent at the endpoint's host) is gone, and the peers of a rank that died fail in their
next collective, which ends their node's agent: every node stops (the CLI's error then names the rank of its
own node that failed; a remote rank's own error is in its node's output).

Rank 0's output reaches the console; every other rank of this node writes logs/rank_N.log (stderr: logging,
warnings, tracebacks) and logs/rank_N.out (stdout), through torch's per-rank redirects (``RankLogs``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from asyncrl.parent import die_with_parent
from asyncrl.trainer.ranks import SERVER_URL_ENV

RDZV_ID = "asyncrl"
"""The rendezvous id: every node's torchrun passes --rdzv-id asyncrl."""
SHUTDOWN_S = 10
"""How long a rank may take to end after SIGTERM before the agent kills it."""
GRACE_S = SHUTDOWN_S + 10.0
"""How long the agent may take to stop its ranks before the CLI kills it."""
POLL_S = 0.2
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class TrainerRankError(RuntimeError):
    """A trainer rank failed; the message names it, its exception, and the end of its log."""


def run_ranks(run_dir: Path, server: Any) -> None:
    """Run this node's trainer ranks to completion; raise TrainerRankError as soon as one fails."""
    agent = Agent(run_dir, ",".join(server.base_urls))
    try:
        agent.wait(server)
    finally:
        agent.stop()


class Agent:
    """The launcher's process, seen from the CLI."""

    def __init__(self, run_dir: Path, server_urls: str) -> None:
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.error_file = logs / "launcher_error.json"
        self.error_file.unlink(missing_ok=True)
        env = {**os.environ, SERVER_URL_ENV: server_urls, ERROR_FILE_ENV: str(self.error_file)}
        command = [sys.executable, "-m", "asyncrl.trainer.launcher", str(run_dir)]
        self.proc = subprocess.Popen(command, env=env, preexec_fn=die_with_parent())

    def wait(self, server: Any) -> None:
        """Until the agent exited 0; its failure (or the server's death) raises."""
        from asyncrl.serving.handle import check_alive  # here: the agent's process imports the config first

        while (code := self.proc.poll()) is None:
            check_alive(server)
            time.sleep(POLL_S)
        if code != 0:
            raise TrainerRankError(self._failure(code))

    def _failure(self, code: int) -> str:
        """The agent's recorded failure, else its exit code."""
        if not self.error_file.is_file():
            return f"the trainer ranks' launcher exited with code {code}"
        message = json.loads(self.error_file.read_text())["message"]["message"]
        return message.removeprefix(f"{TrainerRankError.__name__}: ")

    def stop(self) -> None:
        """SIGTERM the agent (it stops its ranks), SIGKILL it after GRACE_S. A second Ctrl-C or SIGTERM meanwhile
        is ignored: it would skip the kill of an agent stuck stopping a rank."""
        with _signals_ignored():
            _signal_session(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_session(self.proc, signal.SIGKILL)
                self.proc.wait()


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


class RankLogs(LogsSpecs):
    """torch's per-rank redirects into the run's logs/: local rank 0 (trainer rank 0 on the CLI's node) on the
    console, rank N to rank_N.log (stderr) and rank_N.out (stdout), each rank's error file beside them."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir=str(log_dir))
        self.log_dir = log_dir

    @property
    def root_log_dir(self) -> str:
        return str(self.log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            console = local_rank == 0
            dest.stdouts[local_rank] = "" if console else str(self.log_dir / f"rank_{local_rank}.out")
            dest.stderrs[local_rank] = "" if console else str(log_path(self.log_dir, local_rank))
            error_file = self.log_dir / f"rank_{local_rank}.error.json"
            error_file.unlink(missing_ok=True)  # a resumed run's directory may hold an earlier run's
            dest.error_files[local_rank] = env[ERROR_FILE_ENV] = str(error_file)
        return dest


def log_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank_{rank}.log"


def failure_line(exc: ChildFailedError, log_dir: Path, lines: int = 30) -> str:
    """The first failure among this node's ranks: its rank, exit code, exception and the end of its log. A rank
    that recorded its exception comes before one that did not (the agent's own SIGTERM ends the others, which
    torch lists as failures too); error files order the recorded ones finer than torch's whole seconds."""
    failure = min(exc.failures.values(), key=_failed_at)
    rank = failure.local_rank
    message = failure.message["message"] if isinstance(failure.message, dict) else failure.message
    recorded = os.path.isfile(failure.error_file)
    line = f"trainer rank {rank} exited with code {failure.exitcode}" + (f": {message}" if recorded else "")
    if rank == 0:
        return line + " (its output is above)"
    tail = log_path(log_dir, rank).read_text(errors="replace").splitlines()[-lines:]
    return f"{line}; end of {log_path(log_dir, rank)}:\n" + "\n".join(tail)


def _failed_at(failure: ProcessFailure) -> tuple[bool, float]:
    if os.path.isfile(failure.error_file):
        return False, os.stat(failure.error_file).st_mtime
    return True, float(failure.timestamp)


def main(run_dir: Path) -> int:
    """The launcher's process: this node's ranks through torch's elastic agent, its failure recorded for the
    CLI."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from asyncrl.plan_file import read_plan
    from asyncrl.serving.process import free_port

    plan = read_plan(run_dir)
    t = plan.config.trainer
    launch = LaunchConfig(
        min_nodes=t.nnodes,
        max_nodes=t.nnodes,
        nproc_per_node=plan.ranks_per_node,
        run_id=RDZV_ID,
        rdzv_backend="c10d",
        rdzv_endpoint=t.rdzv_endpoint or f"127.0.0.1:{free_port()}",
        max_restarts=0,  # rank 0 owns the rollout worker and the server's weights: a restarted rank cannot rejoin
        logs_specs=RankLogs(run_dir / "logs"),
        shutdown_timeout=SHUTDOWN_S,
        local_addr="127.0.0.1" if t.nnodes == 1 else None,
    )
    try:
        elastic_launch(launch, sys.executable)("-m", "asyncrl.trainer.rank_main", str(run_dir))
    except ChildFailedError as exc:
        get_error_handler().record_exception(TrainerRankError(failure_line(exc, run_dir / "logs")))
        return 1
    except SignalException as exc:  # the CLI stops the ranks with SIGTERM and says why itself
        return 128 + exc.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
