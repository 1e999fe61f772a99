"""The CLI's supervision of the trainer ranks: one rank failing, or the server exiting, stops every rank, and the
error names what failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asyncrl.config import compose, to_config
from asyncrl.config.compose import to_yaml
from asyncrl.server.process import ServerStartError
from asyncrl.trainer.supervise import RankProcesses, TrainerRankError, run_ranks


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[RankProcesses]:
    """The RankProcesses that run_ranks starts, kept to check their processes afterwards."""
    kept: list[RankProcesses] = []
    real_init = RankProcesses.__init__

    def keep(self: RankProcesses, *args: object) -> None:
        real_init(self, *args)
        kept.append(self)

    monkeypatch.setattr(RankProcesses, "__init__", keep)
    return kept


class HealthyServer:
    base_url = "http://127.0.0.1:9"

    def is_alive(self) -> bool:
        return True


def test_a_failed_rank_stops_the_others_and_is_named(random_tiny_model_dir, tmp_path, started):
    """Rank 0 fails (its data is missing) while rank 1 has loaded the model and waits for it."""
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", "trainer.num_processes=2",
                                f"data.path={tmp_path / 'missing.jsonl'}"]))  # fmt: skip
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    with pytest.raises(TrainerRankError, match=r"trainer rank \d exited with code"):
        run_ranks(tmp_path, 2, HealthyServer())
    assert [proc.poll() is not None for proc in started[0].procs] == [True, True]
    assert Path(tmp_path / "logs" / "rank_1.log").is_file()


class ExitedServer(HealthyServer):
    def is_alive(self) -> bool:
        return False

    def log_summary(self) -> str:
        return "torch.OutOfMemoryError: CUDA out of memory (log: logs/server.log)"


def test_a_server_that_exits_while_the_ranks_start_stops_them(random_tiny_model_dir, tmp_path, started):
    """The ranks start while the launched server boots (rank 0 waits for its health): its exit ends them."""
    (tmp_path / "config.yaml").write_text(to_yaml(to_config(compose([f"model.name_or_path={random_tiny_model_dir}"]))))
    exited = r"the generation server exited: torch.OutOfMemoryError: CUDA out of memory \(log: logs/server.log\)"
    with pytest.raises(ServerStartError, match=exited):
        run_ranks(tmp_path, 2, ExitedServer())
    assert [proc.poll() is not None for proc in started[0].procs] == [True, True]


def test_a_leaving_rank_runs_its_exit_handlers_flushes_and_keeps_its_code():
    """``leave`` skips the interpreter's teardown, not what a normal exit does before it."""
    script = ("import atexit, sys; from asyncrl.trainer.distributed import leave; "
              "atexit.register(print, 'handler ran'); print('buffered', end=' '); leave(3)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered handler ran\n"


def test_a_second_interrupt_does_not_cut_the_ranks_stop_short(monkeypatch):
    monkeypatch.setattr("asyncrl.trainer.supervise.GRACE_S", 2.0)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print(flush=True); time.sleep(120)"], stdout=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    stuck.stdout.readline()  # its SIGTERM is ignored from here on
    ranks = RankProcesses.__new__(RankProcesses)
    ranks.procs = [stuck]
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C again while it waits
    ranks.stop()
    assert stuck.returncode == -signal.SIGKILL
