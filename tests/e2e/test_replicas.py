"""Several generation servers behind one run: rollouts spread over both, every sync reaches both, and a replica
that dies stops the run naming it. The attached run uses the session's two built-in servers; the launched one
starts its own two (server.replicas=2) and kills one mid-run."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.trainer.checkpoint import checkpoint_step, list_checkpoints

from .helpers import (
    CliRun,
    free_port_pair,
    kill_marked,
    marked_pids,
    run_cli,
    served_vs_trained,
    start_cli,
    wait_no_marked,
)
from .test_train import common_args, steps_of

pytestmark = pytest.mark.e2e

STEPS = 3


@dataclass
class ReplicasRun:
    run: CliRun
    run_dir: Path
    versions: list[str]
    gaps: list[float]


@pytest.fixture(scope="module")
def replicas_run(random_tiny_model_dir, arithmetic_data_dir, fresh_replicas, tmp_path_factory) -> ReplicasRun:
    servers = fresh_replicas()
    run_dir = tmp_path_factory.mktemp("replicas") / "run"
    urls = ",".join(server.base_url for server in servers)
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), f"trainer.max_steps={STEPS}",
            "staleness.max_staleness=1", "sampling.max_completion_length=32", "server.launch=false",
            f"server.base_urls=[{urls}]",
            "trainer.cpu_threads=1"]  # fmt: skip
    run = run_cli(args, timeout_s=300)
    versions = [ControlClient(server.base_url).weight_version() for server in servers]
    gaps = []
    if run.returncode == 0:
        trained = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
        gaps = [served_vs_trained(server.base_url, trained) for server in servers]
    return ReplicasRun(run, run_dir, versions, gaps)


def test_rollouts_reach_both_servers_and_are_counted_per_server(replicas_run):
    assert replicas_run.run.returncode == 0, replicas_run.run.output[-3000:]
    steps = steps_of(replicas_run.run_dir)
    counts = [sum(s.get(f"rollout/server_{i}_request_count", 0) for s in steps) for i in (0, 1)]
    assert min(counts) > 0, counts
    assert wait_no_marked(replicas_run.run.marker) == []


def test_every_sync_reaches_both_servers(replicas_run):
    """After the last sync both serve the trained model's logprobs (float32, 1e-4), under its version."""
    assert replicas_run.run.returncode == 0, replicas_run.run.output[-3000:]
    assert replicas_run.versions == [str(STEPS), str(STEPS)]
    assert max(replicas_run.gaps) <= 1e-4, replicas_run.gaps


def test_a_dead_replica_ends_the_run_with_one_line_naming_it(random_tiny_model_dir, arithmetic_data_dir, tmp_path):
    """Two launched replicas on ports P and P+1; replica 1 is killed once the first checkpoint is saved. The line
    names the replica, its pid and the signal, and ends on the command that resumes from the newest checkpoint."""
    run_dir, port = tmp_path / "run", free_port_pair()
    common = [arg for arg in common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir)
              if not arg.startswith(("server.port=", "trainer.max_steps=", "trainer.save_steps="))]  # fmt: skip
    args = ["train", *common, "trainer.max_steps=500", "trainer.save_steps=1", "server.replicas=2",
            "sampling.max_completion_length=16",
            f"server.port={port}", "trainer.cpu_threads=1"]  # fmt: skip
    proc, marker = start_cli(args)
    try:
        deadline = time.monotonic() + 180
        while not list_checkpoints(run_dir) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        replica = [pid for pid in marked_pids(marker) if f"--port\0{port + 1}\0".encode() in _cmdline(pid)]
        assert len(replica) == 1
        os.kill(replica[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
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
    assert wait_no_marked(marker) == []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
