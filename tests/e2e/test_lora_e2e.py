"""The CLI with LoRA on CPU: adapters train, merged syncs reach the built-in server (its logprobs equal the
trained adapter's), and the checkpoint and final model hold the adapter (resume: tests/trainer/test_lora.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.server.process import ServerProcess, free_port

from .helpers import run_cli, wait_no_marked
from .test_train import common_args, steps_of

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(random_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.server", "--model", str(random_tiny_model_dir), "--port", str(port),
            "--device", "cpu"]  # fmt: skip
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as process:  # fmt: skip
        yield process


def served_vs_trained(base_url: str, model: torch.nn.Module) -> float:
    prompt = [3, 40, 41, 42, 43]
    body = {"model": ControlClient(base_url).served_model_name(), "prompt": prompt, "max_tokens": 12,
            "temperature": 1.0, "logprobs": 0, "seed": 7, "return_token_ids": True}  # fmt: skip
    choice = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    trained = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return float((trained - torch.tensor(served)).abs().max())


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
