"""benchmarks/chaos.py, short: the embedded default with trainer.max_restarts on 60 prompts, checkpointing every 2
steps, two faults: its newest checkpoint corrupted, then its rollout worker killed (the restart sets the checkpoint
aside and resumes from the one before; the worker's kill -9 is the worker_kill fault's, so that fault is not run
again), then its launcher killed (the driver runs the resume command); then stopped with SIGTERM and resumed from the
printed command to its end. Nothing lost, nothing trained twice, each completed epoch covers the dataset once, no
process or /dev/shm file left. The other faults (the server killed or hung, the network stalled, the disk full) are
the benchmark's (`python benchmarks/chaos.py`, its table in benchmarks/RESULTS.md); below it the restart each one
ends in is tests/test_restart.py's, the watchdog that notices a hung server tests/serving/test_watchdog.py's, and
a dead replica's line tests/e2e/test_multigpu.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .helpers import REPO, cli_env, free_port_pair

pytestmark = [pytest.mark.e2e, pytest.mark.long]


def test_a_run_survives_a_restart_and_a_relaunch_losing_nothing(tmp_path):
    out = tmp_path / "chaos"
    command = [sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--faults", "2", "--cycle",
               "--kinds", "corrupt_checkpoint,launcher_kill", "--gap", "0", "1", "--save-steps", "2",
               "--finish-steps", "1",
               "--prompts", "60", "--port", str(free_port_pair()), "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, env=cli_env("chaos"), timeout=570, cwd=REPO)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    faults = json.loads((out / "faults.json").read_text())
    assert [(f["kind"], f["outcome"], f["orphans"]) for f in faults] == [
        ("corrupt_checkpoint", "restarted", 0),
        ("launcher_kill", "relaunched", 0),
    ]
    checks = json.loads((out / "checks.json").read_text())
    assert checks["steps_missing"] == checks["steps_duplicated"] == 0
    assert checks["prompts_lost"] == checks["prompts_duplicated"] == checks["consumed_goes_back"] == 0
    epochs = checks["epochs_completed"]  # 60 prompts: several epochs, each checked against the dataset
    assert epochs >= 2 and checks["epochs_each_row_once"] == f"{epochs}/{epochs}" and checks["done_past_cursor"]
    assert checks["consumed_logged_at_end"] == checks["prompts_consumed"]
    assert checks["checkpoints_bad"] == [] and checks["orphan_processes_at_end"] == 0
    corrupt = [f["damaged"] for f in faults if f["kind"] == "corrupt_checkpoint"]
    assert corrupt in (["set aside"], ["superseded"])  # superseded: a save came before the run noticed the fault
    assert checks["damaged_checkpoints_set_aside"] == corrupt.count("set aside")
    assert checks["restarts_logged"] == 1  # perf/restarts: the launcher's death is not a restart of the run
    assert checks["dev_shm_left"] in ([], "not isolated")
    restarts = [line for line in (out / "console.log").read_text().splitlines() if line.startswith("restart ")]
    assert len(restarts) == 1 and restarts[0].startswith("restart 1/100000 (RolloutWorkerError): the rollout worker")
