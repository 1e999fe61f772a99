"""The real CLI with two trainer ranks on CPU (gloo, FSDP2), started by torch's launcher, and two launched server
replicas: on one node it trains, syncs both servers and checkpoints sharded and consolidated weights until replica 1
is killed, which ends the run in one line naming the replica and the resume command. Then two "nodes" of one rank
each (the second one a plain torchrun at the first's c10d rendezvous) resume from its checkpoint and train on,
attached to the session's two servers: rollouts reach both, counted per server, and the last sync leaves both
serving the trained model. In both runs the CLI alone plans and writes plan.json: the ranks' launcher, the ranks,
the rollout worker, the servers and the second node plan nothing (a recorder loaded into every Python process of
the runs logs each planning call with its pid). One chain of runs, since each start of two ranks and two servers
costs a minute of CI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.metrics import read_jsonl
from asyncrl.plan_file import PLAN_FILE, read_plan
from asyncrl.serving.process import ServerProcess, free_port
from asyncrl.trainer.checkpoint import checkpoint_step, list_checkpoints

from .helpers import (
    REPO,
    CliRun,
    cli_env,
    free_port_pair,
    kill_marked,
    marked_pids,
    plan_recorder,
    planners,
    run_cli,
    served_vs_trained,
    start_cli,
    wait_no_marked,
)

pytestmark = [pytest.mark.e2e, pytest.mark.long]


def args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train", f"model.name_or_path={model}", f"data.path={data / 'train.jsonl'}", "data.eval_path=null",
        "reward=length", "packing.token_budget=512", "trainer.save_steps=1", "sampling.max_completion_length=32",
        "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip


def request_counts(steps: list[dict]) -> list[int]:
    return [sum(row.get(f"rollout/server_{i}_request_count", 0) for row in steps) for i in (0, 1)]


def test_two_ranks_and_two_replicas_train_until_one_dies_then_two_nodes_resume_on_two_servers(
    random_tiny_model_dir, arithmetic_data_dir, fresh_replicas, tmp_path
):  # fmt: skip
    run_dir, port = tmp_path / "run", free_port_pair()
    two = args(random_tiny_model_dir, arithmetic_data_dir, run_dir, "trainer.num_processes=2", "server.replicas=2",
               "trainer.max_steps=500", f"server.port={port}")  # fmt: skip
    recorder, calls = plan_recorder(tmp_path / "first")
    run = run_until_a_replica_dies(two, run_dir, port, recorder)
    assert "HTTP Request" not in run.output  # rank 0's console: libraries' INFO records stay off it
    assert set(planners(calls)) == {run.pid}, calls.read_text()  # the CLI planned; no other process of the run
    assert read_plan(run_dir).world_size == 2 and (run_dir / PLAN_FILE).is_file()
    steps = read_jsonl(run_dir / "metrics.jsonl")
    newest = checkpoint_step(list_checkpoints(run_dir)[-1])
    assert [row["step"] for row in steps] == list(range(1, newest + 1)) and newest >= 2
    assert all(row["perf/weight_sync_s"] > 0 and row["model_version"] == row["step"] for row in steps)
    assert min(request_counts(steps)) > 0
    for checkpoint in list_checkpoints(run_dir):  # the newest two (tiny_arith's save_total_limit)
        assert any((checkpoint / "sharded").glob("*.distcp")) and (checkpoint / "model.safetensors").is_file()
        assert json.loads((checkpoint / "trainer_state.json").read_text())["num_processes"] == 2
    assert (run_dir / "logs" / "rank_1.log").is_file()

    # the same run directory as two "nodes" of one rank each (a plain torchrun at the CLI's c10d rendezvous): resume
    # the checkpoint and train a step (a resume on another rank count: trainer/test_distributed.py) on the session's
    # two servers, which need no reset: the resumed trainer pushes its checkpoint's weights before generating
    servers = fresh_replicas()
    end = newest + 1
    recorder, calls = plan_recorder(tmp_path / "second")
    train_on_two_nodes(random_tiny_model_dir, arithmetic_data_dir, run_dir, servers, recorder,
                       f"trainer.max_steps={end}", "trainer.resume_from_checkpoint=latest")  # fmt: skip
    planned = planners(calls)  # the CLI alone: the second node's torchrun and rank read plan.json
    assert len(planned) == 1, calls.read_text()
    (lines,) = planned.values()
    assert all(line.split()[1].endswith(str(Path("asyncrl") / "__main__.py")) for line in lines), lines  # the CLI
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in steps] == list(range(1, end + 1))
    assert min(request_counts(steps[newest:])) > 0  # the resumed step's rollouts went to both servers
    state = json.loads((run_dir / "checkpoints" / f"step_{end:06d}" / "trainer_state.json").read_text())
    assert (state["step"], state["model_version"], state["num_processes"]) == (end, end, 2)
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
    for server in servers:  # the last sync reached both: each serves the trained model's logprobs under its version
        assert ControlClient(server.base_url).weight_version() == str(end)
        assert served_vs_trained(server.base_url, trained) <= 1e-4


def run_until_a_replica_dies(command: list[str], run_dir: Path, port: int, env: dict[str, str]) -> CliRun:
    """Start the run, kill -9 replica 1 (port + 1) once step 2's checkpoint is saved: the run ends in one line naming
    the replica, its pid and the signal, and the command that resumes from the newest checkpoint."""
    proc, marker = start_cli(command, env=env)
    started = time.monotonic()
    try:
        while not [p for p in list_checkpoints(run_dir) if checkpoint_step(p) >= 2]:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - started < 300, "no checkpoint of step 2 in 300 s"
            time.sleep(0.2)
        replica = [pid for pid in marked_pids(marker) if f"--port\0{port + 1}\0".encode() in _cmdline(pid)]
        assert len(replica) == 1
        os.kill(replica[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=180)
        assert wait_no_marked(marker) == []
    finally:
        kill_marked(marker)
    assert proc.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error")]
    assert len(errors) == 1, output[-3000:]
    newest = list_checkpoints(run_dir)[-1]
    assert re.fullmatch(
        rf"error \(ServerStartError\): replica 1 of 2: the generation server at http://127\.0\.0\.1:{port + 1} "
        rf"\(built-in, pid {replica[0]}\) was killed by SIGKILL; its log's last line: .+ "
        rf"\(log: {re.escape(str(run_dir / 'logs' / 'server_1.log'))}\) \(details: .+\); "
        rf"resume from {newest.name} \(step {checkpoint_step(newest)}\) with: asyncrl train .+ "
        rf"trainer\.resume_from_checkpoint=latest hydra\.run\.dir={re.escape(str(run_dir))}",
        errors[0],
    ), errors
    assert "Traceback" not in output
    return CliRun(proc.returncode, output, time.monotonic() - started, marker, proc.pid)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def second_node(run_dir: Path, endpoint: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """The other node's command, as the README gives it."""
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "asyncrl",
               "-m", "asyncrl.trainer.rank_main", str(run_dir)]  # fmt: skip
    node = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cli_env(marker, env), cwd=REPO)  # fmt: skip
    return node, marker


def train_on_two_nodes(
    model: Path, data: Path, run_dir: Path, servers: list[ServerProcess], env: dict[str, str], *extra: str
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node, marker = second_node(run_dir, endpoint, env)
    two_nodes = ["trainer.nnodes=2", f"trainer.rdzv_endpoint={endpoint}", "trainer.num_processes=1"]
    urls = ",".join(server.base_url for server in servers)
    attach = ["server.launch=false", f"server.base_urls=[{urls}]", "trainer.cpu_threads=1"]
    run = run_cli(args(model, data, run_dir, *two_nodes, *attach, *extra), timeout_s=300, env=env)
    try:
        assert run.returncode == 0, run.output[-3000:]
        assert node.wait(timeout=60) == 0, node.communicate()[0][-3000:]
        assert wait_no_marked(run.marker) == [] and wait_no_marked(marker) == []
    finally:
        node.kill()
        kill_marked(run.marker)
        kill_marked(marker)
