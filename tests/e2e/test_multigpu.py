"""The real CLI with two trainer ranks on CPU (gloo, FSDP2), started by torch's launcher, and two server replicas:
on one node it trains, syncs both servers, checkpoints sharded and consolidated weights and leaves no process
behind; then two "nodes" of one rank each (the second one a plain torchrun at the first's c10d rendezvous) resume
from its checkpoint and train on, attached to the session's server (the launch is the first run's)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import ServerProcess, free_port

from .helpers import REPO, cli_env, free_port_pair, kill_marked, run_cli, wait_no_marked
from .test_train import attach

pytestmark = [pytest.mark.e2e, pytest.mark.long]


def args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train", f"model.name_or_path={model}", f"data.path={data / 'train.jsonl'}", "data.eval_path=null",
        "reward=length", "packing.token_budget=512", "trainer.max_steps=2", "trainer.save_steps=1",
        "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}", f"server.port={free_port()}",
        *extra,
    ]  # fmt: skip


def test_two_ranks_train_sync_checkpoint_and_stop(random_tiny_model_dir, arithmetic_data_dir, session_server, tmp_path):
    """Two ranks and two server replicas (the second on the next port): both servers get rollouts and syncs."""
    run_dir, port = tmp_path / "run", free_port_pair()
    two = [*args(random_tiny_model_dir, arithmetic_data_dir, run_dir, "trainer.num_processes=2", "server.replicas=2")]
    run = run_cli([a for a in two if not a.startswith("server.port=")] + [f"server.port={port}"], timeout_s=300)
    try:
        assert run.returncode == 0, run.output[-3000:]
        assert wait_no_marked(run.marker) == []
    finally:
        kill_marked(run.marker)
    assert "HTTP Request" not in run.output  # rank 0's console: libraries' INFO records stay off it
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["perf/weight_sync_s"] > 0 and row["model_version"] == row["step"] for row in steps)
    assert all(sum(row.get(f"rollout/server_{i}_request_count", 0) for row in steps) > 0 for i in (0, 1))
    for step in ("step_000001", "step_000002"):  # periodic and final
        checkpoint = run_dir / "checkpoints" / step
        assert any((checkpoint / "sharded").glob("*.distcp")) and (checkpoint / "model.safetensors").is_file()
        assert json.loads((checkpoint / "trainer_state.json").read_text())["num_processes"] == 2
    assert (run_dir / "model" / "model.safetensors").is_file() and (run_dir / "logs" / "rank_1.log").is_file()

    # the same run directory as two "nodes" of one rank each (a plain torchrun at the CLI's c10d rendezvous): resume
    # the checkpoint and train a step (a resume on another rank count: trainer/test_distributed.py); the session's
    # server needs no reset: the resumed trainer pushes its checkpoint's weights before generating
    train_on_two_nodes(random_tiny_model_dir, arithmetic_data_dir, run_dir, session_server, "trainer.max_steps=3",
                       "trainer.resume_from_checkpoint=latest")  # fmt: skip
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert (state["step"], state["model_version"], state["num_processes"]) == (3, 3, 2)


def second_node(run_dir: Path, endpoint: str) -> tuple[subprocess.Popen[str], str]:
    """The other node's command, as the README gives it."""
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "asyncrl",
               "-m", "asyncrl.trainer.rank_main", str(run_dir)]  # fmt: skip
    node = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cli_env(marker), cwd=REPO)  # fmt: skip
    return node, marker


def train_on_two_nodes(model: Path, data: Path, run_dir: Path, server: ServerProcess, *extra: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node, marker = second_node(run_dir, endpoint)
    two_nodes = ["trainer.nnodes=2", f"trainer.rdzv_endpoint={endpoint}", "trainer.num_processes=1"]
    run = run_cli(args(model, data, run_dir, *two_nodes, *attach(server), *extra), timeout_s=300)
    try:
        assert run.returncode == 0, run.output[-3000:]
        assert node.wait(timeout=60) == 0, node.communicate()[0][-3000:]
        assert wait_no_marked(run.marker) == [] and wait_no_marked(marker) == []
    finally:
        node.kill()
        kill_marked(run.marker)
        kill_marked(marker)
