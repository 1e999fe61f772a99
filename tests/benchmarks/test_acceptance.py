"""benchmarks/acceptance.py's own logic, without running a row: the table's columns from metrics records, the
resume command read from Ctrl-C's output, the failure rules and the row selection; for the fault rows, the server
found by its command line, the line a failed run ended with, the resumed run's steps and nvidia-smi's leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
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
    full_disk = (
        "error (OSError): No space left on device writing runs/x/metrics.jsonl: free space there; resume from "
        "step_000004 (step 4) with: asyncrl train trainer.max_steps=4 trainer.resume_from_checkpoint=latest\n"
    )
    said, argv = acceptance.resume_command(full_disk)
    assert said.endswith("free space there, resume from step_000004 (step 4)") and argv[-1].endswith("=latest")
    said, argv = acceptance.resume_command(CRASH)  # any failure once a checkpoint exists (launch.py)
    assert said == f"{KILLED} (details: runs/x/launch.log), resume from step_000002 (step 2)"
    assert argv[2:] == ["trainer.max_steps=4", "trainer.save_steps=2", "trainer.resume_from_checkpoint=latest",
                        "hydra.run.dir=runs/x"]  # fmt: skip


KILLED = (
    "error (ServerStartError): the generation server at http://127.0.0.1:8000 (built-in, pid 4242) was killed by "
    "SIGKILL; its log's last line: 2026-12-02 14:53:55,025 asyncrl.engine.api: loaded 46 tensors from "
    "/dev/shm/w/weights-2.safetensors (log: runs/x/logs/server.log)"
)
CRASH = (
    "Loading weights: 100%|##########| 46/46\n"
    f"{KILLED} (details: runs/x/launch.log); resume from step_000002 (step 2) with: asyncrl train "
    "trainer.max_steps=4 trainer.save_steps=2 trainer.resume_from_checkpoint=latest hydra.run.dir=runs/x\n"
    "  (a server's log tail may follow the line)\n\n"
)


def test_a_failed_run_ends_on_its_error_line_else_its_last(acceptance: ModuleType) -> None:
    ended = acceptance.ending_line(CRASH)
    assert ended.startswith(KILLED)
    assert acceptance.re.search(acceptance.ENDINGS["kill"], ended)
    assert not acceptance.re.search(acceptance.ENDINGS["oom"], ended)
    hung = (
        "error (ServerStartError): the generation server at http://127.0.0.1:8000 (vLLM, pid 7) stopped answering "
        "/health for 120 s (server.health_timeout) during a weight sync: it hangs; raise server.health_timeout if it "
        "is only slow (details: x/launch.log)"
    )
    assert acceptance.re.search(acceptance.ENDINGS["hang"], acceptance.ending_line(f"{hung}\n"))
    assert not acceptance.re.search(acceptance.ENDINGS["hang"], ended)
    assert acceptance.ending_line("Traceback (most recent call last):\n  ...\nKeyError: 'x'\n") == "KeyError: 'x'"


def test_the_server_is_found_by_its_launch_command_with_everything_below_it(acceptance: ModuleType) -> None:
    from asyncrl.config.compose import compose
    from asyncrl.plan.assemble import placed, plan_run, sized
    from asyncrl.serving.command import builtin_command
    from asyncrl.serving.vllm import CheckpointKind, vllm_command

    builtin = builtin_command(plan_run(compose(["server=builtin"]))).argv
    placed_plan = placed(plan_run(compose(["server=vllm", "model.name_or_path=Qwen/Qwen3-4B"])), ["0"])
    plan = sized(placed_plan, prompt_tokens=200)
    vllm = vllm_command(plan, version="0.33.0", checkpoint=CheckpointKind()).argv
    script = ["/venv/bin/python3", "/venv/bin/vllm", "serve", "Qwen/Qwen3-4B", "--port", "8000"]
    assert all(acceptance.is_server(argv) for argv in (builtin, vllm, script))
    cli = acceptance.asyncrl(["train", "server=vllm", "trainer.max_steps=4"])
    rank = [sys.executable, "-m", "asyncrl.trainer.rank_main", "runs/x"]
    worker = [
        sys.executable,
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main()",
        "--multiprocessing-fork",
    ]
    assert not any(acceptance.is_server(argv) for argv in (cli, rank, worker, ["VLLM::EngineCore"], ["-m"], []))
    # the CLI's processes: the worker (11), vLLM (12) and, below it, an API process and the engine core (13, 14)
    argvs = {11: worker, 12: vllm, 13: ["VLLM::APIServer"], 14: ["VLLM::EngineCore"]}
    tree = {11: "t11", 12: "t12", 13: "t13", 14: "t14"}
    below = {12: {13: "t13", 14: "t14"}}
    found = acceptance.server_processes(tree, below=lambda pid: below.get(pid, {}), argv=argvs.__getitem__)
    assert found == {12: "t12", 13: "t13", 14: "t14"}
    assert acceptance.server_processes({11: "t11"}, below=lambda pid: {}, argv=argvs.__getitem__) == {}


def test_the_fault_waits_for_the_first_checkpoint_and_a_server_to_find(acceptance: ModuleType, tmp_path: Path) -> None:
    answers = iter([None, "SIGKILL to the server's 2 processes", "again"])
    calls: list[object] = []

    def act(proc: object) -> str | None:
        calls.append(proc)
        return next(answers)

    poll, done = acceptance.at_checkpoint(tmp_path, act)
    checkpoints = tmp_path / "runs" / "r" / "checkpoints"
    (checkpoints / "step_000002.tmp").mkdir(parents=True)  # a save in progress is no checkpoint yet
    poll("proc")
    assert calls == [] and acceptance.checkpoint_steps(tmp_path) == []
    (checkpoints / "step_000004").mkdir()
    (checkpoints / "step_000002").mkdir()
    for _ in range(3):
        poll("proc")
    assert done == ["SIGKILL to the server's 2 processes"] and len(calls) == 2  # no server yet, then once
    assert acceptance.checkpoint_steps(tmp_path) == [2, 4]


def test_a_resumed_run_starts_at_its_checkpoint_and_logs_each_step_once(acceptance: ModuleType) -> None:
    log = (
        "[2026-12-02 14:56:33][asyncrl][ERROR] - restart 1/1 (ServerStartError): ...\n"
        "[14:56:39][asyncrl.trainer][INFO] - resumed from runs/x/checkpoints/step_000002 at step 2, prompt 68\n"
    )
    assert acceptance.resumed_step(log) == 2 and acceptance.resumed_step("no resume here") is None
    assert acceptance.continuity([1, 2, 3, 4], resumed=2, checkpoint=2, max_steps=4) == []
    assert acceptance.continuity([1, 2, 3, 3, 4], resumed=4, checkpoint=2, max_steps=4) == [
        "resumed at step 4, not at its checkpoint's, 2", "metrics.jsonl steps 1,2,3,3,4, not 1-4 once each"
    ]  # fmt: skip
    assert acceptance.continuity([1, 2], resumed=None, checkpoint=2, max_steps=4)[1].endswith("not 1-4 once each")
    restarted = f"restart 1/1 {KILLED.removeprefix('error ')}; resuming from step_000002 (step 2)\n"
    said, step = acceptance.restart_line("Loading weights\n" + restarted)
    assert said == restarted.strip() and step == 2
    assert (
        acceptance.restart_line("restart 1/1 (ServerStartError): x; resuming from the start (no checkpoint yet)")
        is None
    )


def test_the_rows_processes_left_on_the_gpu_fail_it(acceptance: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    apps = [["100", "python", "30000"], ["999", "someone else", "7"], ["[N/A]", "[N/A]", "[N/A]"]]
    monkeypatch.setattr(acceptance, "_smi", lambda query: apps if query.startswith("--query-compute-apps") else [])
    monkeypatch.setattr(acceptance, "LEFTOVER_GRACE_S", 0.0)
    assert acceptance.gpu_holders({100, 101}) == ["100 python (30000 MiB)"]
    assert acceptance.gpu_holders({101}) == []
    result = acceptance.Result("vllm-killed", rc=0)
    result.outcomes.append(acceptance.Outcome(1, 2.0, [], acceptance.gpu_holders({100})))
    acceptance.judge(result, steps=0, expected_runs=0)
    assert result.problems == ["still on the GPU (nvidia-smi): 100 python (30000 MiB)"]


def test_the_oom_row_is_skipped_without_a_gpu(
    acceptance: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = acceptance.Context(tmp_path, 4, rehearse=True, row_timeout=60.0, vllm=False, cuda=False)
    (oom,) = acceptance.select("oom")
    result = acceptance.run_row(oom, ctx)
    assert result.skipped and not (tmp_path / "rows").exists()
    assert "[acceptance] oom skipped: a CUDA out-of-memory needs a GPU" in capsys.readouterr().out
    assert acceptance.table_line(result, gpu=None).startswith("| oom | - | 0 |")
    assert "| skipped: a CUDA out-of-memory needs a GPU" in acceptance.table_line(result, gpu=None)


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
    """Each call of a device session runs what is left: rows --passed lists at this code version keep their line
    (one passed at another runs again; a pass is appended there), and a row starts only with its --row-timeout
    left of --budget (a call cut by the device's limit writes no table)."""
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
    version, carried = acceptance.code_version(), tmp_path / "carried.md"
    acceptance.record_pass(carried, version, "| builtin | 0 | earlier |")
    acceptance.record_pass(carried, "older", "| default | 0 | older |")  # passed at another code version: run again
    argv = ["acceptance.py", "--rehearse", "--work", str(tmp_path), "--rows", "builtin,default,lora", "--skip-passed",
            "--passed", str(carried)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [*argv, "--budget", "100", "--row-timeout", "60"])
    with pytest.raises(SystemExit) as exited:
        acceptance.main()
    table = (tmp_path / "acceptance.md").read_text()
    assert ran == ["default"] and exited.value.code == 1  # then 50 s + lora's 60 s would overrun the 100 s
    assert "| builtin | 0 | earlier |" in table and "| default | 0 | ok |" in table
    assert "| lora |" in table and "not run: --budget spent" in table
    assert acceptance.passed_rows(carried, version) == {"builtin": "| builtin | 0 | earlier |",
                                                        "default": "| default | 0 | ok |"}  # fmt: skip
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


def test_a_stopped_process_left_behind_is_reported_and_killed(
    acceptance: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-hung's server, SIGSTOPped: one that asyncrl did not end counts as left behind, and SIGKILL ends it."""
    monkeypatch.setattr(acceptance, "LEFTOVER_GRACE_S", 0.0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = acceptance.descendants(os.getpid())[child.pid]
        os.kill(child.pid, signal.SIGSTOP)
        assert acceptance.alive(child.pid, started)
        (left,) = acceptance.survivors({child.pid: started})
        assert left.startswith(f"{child.pid} {sys.executable} -c import time")
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_an_oom_row_whose_run_trains_on_beside_the_hog_passes_saying_so(
    acceptance: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process took the GPU's free memory, and every step still fit the trainer's cached memory: nothing
    was lost, so the row passes (the run's steps are judged as any row's), and its note says the fault changed
    nothing. A kill that the run survives with exit 0 is still a failure."""
    (tmp_path / "runs" / "r" / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "console0.err").write_text("done\n")

    def train(result, row_dir, args, ctx, poll=None):  # type: ignore[no-untyped-def]
        poll(None)  # the run's first checkpoint exists: the fault is made
        outcome = acceptance.Outcome(0, 1.0, [])
        result.outcomes.append(outcome)
        result.rc = 0
        return outcome

    monkeypatch.setattr(acceptance, "train", train)
    hog = acceptance.contextlib.nullcontext(lambda proc: "a memory hog took 120.0 GiB of the GPU")
    monkeypatch.setitem(acceptance.FAULTS, "oom", lambda row_dir: hog)
    monkeypatch.setitem(
        acceptance.FAULTS, "kill", lambda row_dir: acceptance.contextlib.nullcontext(lambda proc: "SIGKILL")
    )
    ctx = acceptance.Context(tmp_path, 4, False, 60.0, True)
    rows = {row.name: row for row in acceptance.ROWS}
    trained_on = acceptance.Result("oom")
    acceptance.run_fault(rows["oom"], tmp_path, ctx, None, trained_on)
    assert trained_on.problems == [] and "trained on beside the hog" in trained_on.notes[-1]
    survived = acceptance.Result("vllm-killed")
    acceptance.run_fault(rows["vllm-killed"], tmp_path, ctx, None, survived)
    assert survived.problems == ["the run finished (exit 0)"]


def test_rows_that_start_two_runs_get_twice_the_row_timeout(acceptance: ModuleType) -> None:
    """A resume, an export's serve and a sweep's second job each boot a server again: their limit and their share
    of --budget are two runs' (the sigint row's resume was cut at a one-run limit on the H200)."""
    runs = {row.name: row.runs for row in acceptance.ROWS}
    assert runs["default"] == runs["builtin"] == runs["deepmath"] == runs["lora"] == 1
    assert runs["sigint"] == runs["sweep"] == runs["export"] == runs["vllm-killed"] == runs["oom"] == 2


def test_the_rows_logs_come_back_in_one_archive(acceptance: ModuleType, tmp_path: Path) -> None:
    """A device call returns flat files only: every row's consoles, launch.logs and server logs travel in
    logs.tar.gz, paths kept, and nothing else of the row's directory (checkpoints stay behind)."""
    import tarfile

    rows, out = tmp_path / "rows", tmp_path / "out"
    run = rows / "sigint" / "runs" / "2026-12-03_04-09-47"
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    out.mkdir()
    for path in [rows / "sigint" / "console0.err", rows / "sigint" / "console1.out", run / "launch.log",
                 run / "logs" / "server.log", run / "checkpoints" / "step_000002" / "model.safetensors"]:  # fmt: skip
        path.write_text(path.name)
    acceptance.pack_logs(rows, out)
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = sorted(archive.getnames())
        server = archive.extractfile("sigint/runs/2026-12-03_04-09-47/logs/server.log")
        assert server is not None and server.read() == b"server.log"
    assert names == ["sigint/console0.err", "sigint/console1.out", "sigint/runs/2026-12-03_04-09-47/launch.log",
                     "sigint/runs/2026-12-03_04-09-47/logs/server.log"]  # fmt: skip
