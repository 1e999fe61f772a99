"""The CLI with LoRA on CPU: adapters train, merged syncs reach the built-in server (its logprobs equal the
trained adapter's), adapter-only syncs load each version under a new name that rollouts then request, and the
checkpoint and final model hold the adapter (resume: tests/trainer/test_lora.py)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.serving.process import ServerProcess

from .helpers import run_cli, served_vs_trained, wait_no_marked
from .test_train import common_args, steps_of

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(fresh_server: Callable[[], ServerProcess]) -> ServerProcess:
    return fresh_server()


def test_lora_run_syncs_merged_and_saves_the_adapter(server, random_tiny_model_dir, arithmetic_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "lora=default", "lora.r=8",
            "trainer.max_steps=3", "trainer.save_steps=3", "server.launch=false",
            f"server.base_url={server.base_url}"]  # fmt: skip
    run = run_cli(args, timeout_s=300)
    assert run.returncode == 0, run.output[-3000:]
    assert [s["step"] for s in steps_of(run_dir)] == [1, 2, 3]
    checkpoint = run_dir / "checkpoints" / "step_000003"
    for path in (checkpoint, run_dir / "model"):
        assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    assert ControlClient(server.base_url).weight_version() == "3"
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    trained = PeftModel.from_pretrained(base, run_dir / "model").eval()
    assert served_vs_trained(server.base_url, trained) <= 1e-4
    assert wait_no_marked(run.marker) == []


def test_lora_run_syncs_adapters_that_rollouts_request(random_tiny_model_dir, arithmetic_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "lora=default", "lora.r=8",
            "lora.sync=adapter", "staleness.max_staleness=1", "trainer.max_steps=3",
            "trainer.save_steps=3"]  # fmt: skip
    run = run_cli(args, timeout_s=300)
    assert run.returncode == 0, run.output[-3000:]
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[-1]["model_version"] == 3
    full = (random_tiny_model_dir / "model.safetensors").stat().st_size
    assert all(0 < s["perf/weight_sync_bytes"] < full / 10 for s in steps)
    log = (run_dir / "logs" / "server.log").read_text()
    loaded = re.findall(r": loaded LoRA adapter '(asyncrl-[0-9a-f]+-v\d)'", log)
    requested = set(re.findall(r": first request under LoRA adapter '(asyncrl-[0-9a-f]+-v\d)'", log))
    assert [name[-2:] for name in loaded] == ["v1", "v2", "v3"] and requested & set(loaded[:2])
    assert requested <= set(loaded)
    assert not (run_dir / ".vllm_lora").exists()  # the serving cache goes with the run; the adapter is saved:
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    assert wait_no_marked(run.marker) == []
