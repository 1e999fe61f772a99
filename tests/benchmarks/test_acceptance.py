"""benchmarks/acceptance.py's own logic, without running a row: the table's columns from metrics records, the
resume command read from Ctrl-C's output, the failure rules and the row selection."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import pytest


def record(step: int, **metrics: float) -> dict[str, float]:
    return {"step": step, "perf/step_s": 2.0 * step, "batch/samples_per_step": 12.0, **metrics}


def test_summarise_reads_steady_steps_and_marks_what_is_missing(acceptance: ModuleType) -> None:
    records = [
        record(1, **{"perf/startup_server_healthy_s": 80.0, "perf/startup_first_step_s": 95.5}),
        record(2, **{"perf/weight_sync_s": 0.1}),
        record(3, **{"perf/weight_sync_s": 0.3, "perf/wall_clock_mfu": 0.01, "perf/trainer_peak_memory_gib": 30.0}),
        record(4, **{"perf/wall_clock_mfu": 0.03, "perf/trainer_peak_memory_gib": 28.0}),
        record(5),
    ]
    cells = acceptance.summarise(records, polled_first_s=120.0)
    assert cells == {
        "steps": "5", "healthy s": "80.0", "first step s": "95.5", "steady step s": "8.00", "trainer GiB": "30.0",
        "sync s": "0.200", "samples/s": "1.5", "wall MFU %": "2.00",
    }  # fmt: skip  # steady: steps 3-5 (6, 8, 10 s; 36 samples in 24 s)
    bare = acceptance.summarise([{"step": 1}, {"step": 2}], polled_first_s=41.0)
    assert bare["first step s"] == "41.0*" and bare["healthy s"] == bare["steady step s"] == bare["sync s"] == "-"
    assert acceptance.summarise([], polled_first_s=None)["first step s"] == "-"


def test_resume_command_is_the_one_ctrl_c_printed(acceptance: ModuleType) -> None:
    stderr = (
        "Loading weights: 100%\n"
        "interrupted (SIGINT) at step 3; resume from step_000002 (step 2) with: asyncrl train trainer.max_steps=4 "
        "'data.path=/tmp/my data.jsonl' trainer.resume_from_checkpoint=latest hydra.run.dir=runs/x\n"
    )
    said, argv = acceptance.resume_command(stderr)
    assert said == "interrupted (SIGINT) at step 3, resume from step_000002 (step 2)"
    assert argv == ["asyncrl", "train", "trainer.max_steps=4", "data.path=/tmp/my data.jsonl",
                    "trainer.resume_from_checkpoint=latest", "hydra.run.dir=runs/x"]  # fmt: skip
    nothing = (
        "interrupted (SIGINT) at step 1, before its first checkpoint: nothing to resume; start again with: asyncrl"
    )
    assert acceptance.resume_command(nothing + " train trainer.max_steps=4\n") is None


def test_a_row_fails_on_exit_code_short_runs_and_leftovers(acceptance: ModuleType, tmp_path: Path) -> None:
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    result = acceptance.Result("default", rc=0, runs=[run])
    result.outcomes.append(acceptance.Outcome(0, 3.0, ["123 python -m asyncrl.engine"]))
    acceptance.judge(result, steps=4, expected_runs=2)
    assert result.problems == [
        "1 of 2 runs wrote metrics", "fewer steps than 4: a: 2", "left behind (killed): 123 python -m asyncrl.engine"
    ]  # fmt: skip
    passed = acceptance.Result("default", rc=0, runs=[run])
    acceptance.judge(passed, steps=2, expected_runs=1)
    assert passed.problems == []
    line = acceptance.table_line(result, gpu=None)
    assert line.startswith("| default | 0 | 2 |") and "FAIL: 1 of 2 runs" in line and line.count("|") == 14


def test_rows_are_selected_by_name_in_the_given_order(acceptance: ModuleType) -> None:
    assert [r.name for r in acceptance.select("sweep,builtin")] == ["sweep", "builtin"]
    with pytest.raises(SystemExit, match="no row nope; the rows are builtin,default,"):
        acceptance.select("builtin,nope")


def test_vllm_memory_sums_the_rows_other_processes_else_total_minus_trainer(
    acceptance: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = tmp_path / "nvidia-smi"  # this machine has none: one that answers as the H200's does
    smi.write_text(
        '#!/bin/sh\ncase "$1" in --query-compute-apps*) printf "$APPS";; --query-gpu=memory.used) echo 61440;; esac\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("APPS", "100, 30000\\n101, 40960\\n102, 1024\\n999, 7\\n")
    ours = acceptance.GpuMemory()
    ours.sample(tree={100, 101, 102}, trainer=100)
    assert ours.server_gib(trainer_peak_gib=25.0) == "41.0"  # 40960 + 1024 MiB: not the trainer's, not pid 999's
    monkeypatch.setenv("APPS", "5001, 30000\\n5002, 40960\\n")  # another pid namespace's
    other = acceptance.GpuMemory()
    other.sample(tree={100, 101}, trainer=100)
    assert other.server_gib(trainer_peak_gib=25.0) == "35.0t" and other.server_gib(trainer_peak_gib=None) == "-"


def test_a_passed_row_is_kept_and_rows_past_the_budget_are_not_run(
    acceptance: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call of a device session runs what is left: rows passed in --work at this code version keep their line
    (one passed at another runs again), and a row starts only with its --row-timeout left of --budget (a call cut
    by the device's limit writes no table)."""
    ran: list[str] = []
    clock = [0.0]

    def run_row(row, ctx):  # type: ignore[no-untyped-def]
        ran.append(row.name)
        clock[0] += 50.0  # the row's seconds, on the injected clock
        (ctx.work / "rows" / row.name).mkdir(parents=True, exist_ok=True)
        return acceptance.Result(row.name, rc=0, seconds=1.0)

    monkeypatch.setattr(acceptance, "run_row", run_row)
    monkeypatch.setattr(acceptance.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(acceptance, "table_line", lambda result, gpu: f"| {result.row} | 0 | ok |")
    version, rows = acceptance.code_version(), {row.name: row for row in acceptance.ROWS}
    (tmp_path / "rows" / "builtin").mkdir(parents=True)
    acceptance.passed_mark(tmp_path, rows["builtin"], version).write_text("| builtin | 0 | earlier |\n")
    (tmp_path / "rows" / "default").mkdir(parents=True)  # passed at another code version: run again
    acceptance.passed_mark(tmp_path, rows["default"], "older").write_text("| default | 0 | older |\n")
    argv = ["acceptance.py", "--rehearse", "--work", str(tmp_path), "--rows", "builtin,default,lora", "--skip-passed"]
    monkeypatch.setattr(sys, "argv", [*argv, "--budget", "100", "--row-timeout", "60"])
    with pytest.raises(SystemExit) as exited:
        acceptance.main()
    table = (tmp_path / "acceptance.md").read_text()
    assert ran == ["default"] and exited.value.code == 1  # then 50 s + lora's 60 s would overrun the 100 s
    assert "| builtin | 0 | earlier |" in table and "| default | 0 | ok |" in table
    assert "| lora |" in table and "not run: --budget spent" in table
    assert acceptance.passed_mark(tmp_path, rows["default"], version).is_file()
    assert f"code {version}" in table and "older" not in table


def test_a_failed_rows_log_has_the_server_log_of_a_run_that_never_stepped(
    acceptance: ModuleType, tmp_path: Path
) -> None:
    """A row stopped before its first step wrote no metrics.jsonl: its launch.log and server log still say why."""
    run = tmp_path / "runs" / "2026-12-02_15-27-40"
    (run / "logs").mkdir(parents=True)
    (tmp_path / "console0.err").write_text("interrupted (SIGTERM) at step 0\n")
    (run / "launch.log").write_text("vLLM starts now\n")
    (run / "logs" / "server.log").write_text("compiling the graph\n")
    text = acceptance.failure_log(acceptance.Result("deepmath", problems=["stopped"]), tmp_path)
    assert "vLLM starts now" in text and "compiling the graph" in text and "interrupted (SIGTERM)" in text
