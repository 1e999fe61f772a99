"""The trainer ranks under torch's launcher, seen from the CLI: one rank failing, or the server exiting, stops
every rank, the error names what failed, and no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest
from e2e.helpers import wait_no_marked  # tests/e2e

from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.plan_file import write_plan
from asyncrl.serving.process import ServerStartError
from asyncrl.trainer.launcher import ERROR_FILE_ENV, Agent, RankLogs, TrainerRankError, run_ranks


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    """A mark in the environment of every process the launcher starts, to find any left behind."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("ASYNCRL_TEST_MARKER", mark)
    return mark


class HealthyServer:
    base_urls = ["http://127.0.0.1:9"]

    def is_alive(self) -> bool:
        return True


@pytest.mark.slow
def test_a_failed_rank_stops_the_others_and_is_named(random_tiny_model_dir, tmp_path, marker):
    """Rank 0 fails (its data is missing) while rank 1 has loaded the model and waits for it."""
    write_plan(plan_run(compose([f"model.name_or_path={random_tiny_model_dir}", "trainer.num_processes=2",
                                 f"data.path={tmp_path / 'missing.jsonl'}"])), tmp_path)  # fmt: skip
    with pytest.raises(TrainerRankError) as failed:
        run_ranks(tmp_path, HealthyServer())
    assert str(failed.value).startswith("trainer rank 0 exited with code 1: DatasetError: ")
    assert str(failed.value).endswith("(its output is above)") and "\n" not in str(failed.value)
    assert wait_no_marked(marker) == []
    assert (tmp_path / "logs" / "rank_1.log").is_file()


class ExitedServer(HealthyServer):
    def is_alive(self) -> bool:
        return False

    def death_line(self) -> str:
        return "the generation server at http://127.0.0.1:9 (vLLM, pid 7) exited with code 1: OutOfMemoryError"


def test_a_server_that_exits_while_the_ranks_start_stops_them(random_tiny_model_dir, tmp_path, marker):
    """The ranks start while the launched server boots (rank 0 waits for its health): its exit ends them."""
    write_plan(plan_run(compose([f"model.name_or_path={random_tiny_model_dir}", "trainer.num_processes=2"])), tmp_path)
    exited = r"^the generation server at http://127.0.0.1:9 \(vLLM, pid 7\) exited with code 1: OutOfMemoryError$"
    with pytest.raises(ServerStartError, match=exited):
        run_ranks(tmp_path, ExitedServer())
    assert wait_no_marked(marker) == []


def test_rank_logs_put_rank_zero_on_the_console_and_the_others_in_the_run_logs(tmp_path):
    (tmp_path / "rank_1.error.json").write_text("{}")  # an earlier run's
    envs: dict[int, dict[str, str]] = {0: {"RANK": "2"}, 1: {"RANK": "3"}}
    dest = RankLogs(tmp_path).reify(envs)
    assert dest.stdouts == {0: "", 1: str(tmp_path / "rank_1.out")}
    assert dest.stderrs == {0: "", 1: str(tmp_path / "rank_1.log")}
    assert envs[1][ERROR_FILE_ENV] == dest.error_files[1] == str(tmp_path / "rank_1.error.json")
    assert not (tmp_path / "rank_1.error.json").exists()


def test_the_error_is_the_agents_recorded_failure(tmp_path):
    agent = Agent.__new__(Agent)
    agent.error_file = tmp_path / "launcher_error.json"
    assert agent._failure(1) == "the trainer ranks' launcher exited with code 1"
    message = "trainer rank 1 exited with code 1: ValueError: bad"
    agent.error_file.write_text(json.dumps({"message": {"message": f"TrainerRankError: {message}"}}))
    assert agent._failure(1) == message


def test_a_leaving_rank_runs_its_exit_handlers_flushes_and_keeps_its_code():
    """``leave`` skips the interpreter's teardown, not what a normal exit does before it."""
    script = ("import atexit, sys; from asyncrl.trainer.distributed import leave; "
              "atexit.register(print, 'handler ran'); print('buffered', end=' '); leave(3)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered handler ran\n"


def test_a_second_interrupt_does_not_cut_the_agents_stop_short(monkeypatch):
    monkeypatch.setattr("asyncrl.trainer.launcher.GRACE_S", 2.0)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print(flush=True); time.sleep(120)"], stdout=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    stuck.stdout.readline()  # its SIGTERM is ignored from here on
    agent = Agent.__new__(Agent)
    agent.proc = stuck
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C again while it waits
    agent.stop()
    assert stuck.returncode == -signal.SIGKILL
