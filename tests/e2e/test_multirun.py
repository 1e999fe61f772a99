"""`asyncrl train -m`: one run directory per job, each with its composed config, and a sweep report. The jobs
attach to the session's server one after the other (the sweep, not the launch, is under test). They are LoRA runs
with merged syncs, whose checks (adapters train, the server serves the trained adapter's logprobs, the checkpoint
and final model hold the adapter) are the last job's: one sweep, since each run costs half a minute of CI (adapter-only
syncs: test_lora_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.serving.process import ServerProcess

from .helpers import CliRun, run_cli, served_vs_trained, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 2
LEARNING_RATES = (1e-4, 3e-4)


@pytest.fixture(scope="module")
def server(fresh_server) -> ServerProcess:
    return fresh_server()


@pytest.fixture(scope="module")
def sweep(random_tiny_model_dir, arithmetic_data_dir, server, tmp_path_factory) -> tuple[CliRun, Path]:
    sweep_dir = tmp_path_factory.mktemp("sweep") / "sweep"
    run = run_cli([
        "train", "-m", f"trainer.learning_rate={','.join(map(str, LEARNING_RATES))}", "lora=default", "lora.r=8",
        f"model.name_or_path={random_tiny_model_dir}", f"data.path={arithmetic_data_dir / 'train.jsonl'}",
        "data.eval_path=null", "reward=length", f"trainer.max_steps={STEPS}", f"trainer.save_steps={STEPS}",
        "packing.token_budget=256", "logging.console=plain", f"hydra.sweep.dir={sweep_dir}", "server.launch=false",
        f"server.base_url={server.base_url}",
    ])  # fmt: skip
    return run, sweep_dir


def test_multirun_makes_one_run_dir_per_job(sweep):
    run, sweep_dir = sweep
    assert run.returncode == 0, run.output[-3000:]
    for job, lr in enumerate(LEARNING_RATES):
        composed = yaml.safe_load((sweep_dir / str(job) / ".hydra" / "config.yaml").read_text())
        assert composed["trainer"]["learning_rate"] == lr
        assert (sweep_dir / str(job) / "metrics.jsonl").read_text().count("\n") == STEPS
    report = sweep_dir / "report"
    assert "Reward per job" in (report / "index.html").read_text() or (report / "reward_overlay.png").is_file()
    assert wait_no_marked(run.marker) == []


def test_lora_run_syncs_merged_and_saves_the_adapter(sweep, server, random_tiny_model_dir):
    run, sweep_dir = sweep
    assert run.returncode == 0, run.output[-3000:]
    last = sweep_dir / str(len(LEARNING_RATES) - 1)
    for path in (last / "checkpoints" / f"step_{STEPS:06d}", last / "model"):
        assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    assert ControlClient(server.base_url).weight_version() == str(STEPS)
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    trained = PeftModel.from_pretrained(base, last / "model").eval()
    assert served_vs_trained(server.base_url, trained) <= 1e-4
