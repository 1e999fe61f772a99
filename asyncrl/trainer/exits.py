"""How the processes of a run end: the failures that end one with a line instead of a traceback, SIGTERM as
KeyboardInterrupt, and the record of the restarts after such an end (logs/restarts.jsonl).

Shared by the CLI (cli.py, launch.py), automatic restart (restart.py) and each trainer rank (rank_main.py, whose
loop logs the restart count). The errors come from every layer up to the trainer's, so the module is the trainer's.
"""

from __future__ import annotations

import signal
from pathlib import Path

from asyncrl.config.errors import ConfigError

RESTARTS_FILE = "restarts.jsonl"


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message says everything (bad data, a failed server or worker): no Python traceback. The job
    adds the Hub push's (launch.py's JOB_ERRORS): hub_push.py reads the trainer's checkpoints, above this module."""
    from asyncrl.client import ServerError
    from asyncrl.data import DatasetError
    from asyncrl.registry import RegistryError
    from asyncrl.rollout.spawn import UnpicklableError
    from asyncrl.serving.process import ServerStartError
    from asyncrl.trainer.assembler import RolloutWorkerError
    from asyncrl.trainer.checkpoint import ResumeError
    from asyncrl.trainer.group_watch import TrainingStalledError
    from asyncrl.trainer.launcher import TrainerRankError
    from asyncrl.trainer.memory import TrainerOutOfMemoryError
    from asyncrl.weights.transport import WeightSyncError

    return (
        DatasetError,
        RegistryError,
        ServerStartError,
        ServerError,
        RolloutWorkerError,
        UnpicklableError,
        TrainerRankError,
        ResumeError,
        TrainingStalledError,
        ConfigError,
        WeightSyncError,
        TrainerOutOfMemoryError,
    )


EXPECTED_ERRORS = _expected_errors()


def _config_errors() -> tuple[type[BaseException], ...]:
    """The expected errors that a change of configuration or input fixes: exit code 2, like a bad override."""
    from asyncrl.data import DatasetError
    from asyncrl.trainer.checkpoint import ResumeError

    return ConfigError, DatasetError, ResumeError


CONFIG_ERRORS = _config_errors()


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt("SIGTERM") so context managers stop the children; Ctrl-C raises it too,
    even in a process started from a script's background job, which inherits SIGINT ignored."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def restarts_path(run_dir: Path) -> Path:
    return run_dir / "logs" / RESTARTS_FILE


def restart_count(run_dir: Path) -> int:
    """Restarts the run has had so far, across every launch of it (resumes by hand included)."""
    path = restarts_path(run_dir)
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0
