"""The spec's model families end to end on CPU: `asyncrl train` on a tiny Qwen3.5 vision-language checkpoint (a
gated-DeltaNet hybrid text model behind a vision tower), tree-packed, on the built-in server. The text model
trains and reaches the server; the tower is neither trained nor sent, and `model/` is the whole checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from asyncrl.metrics import read_jsonl

from .helpers import run_cli, served_vs_trained, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 3


def test_a_hybrid_vision_language_checkpoint_trains_text_only(
    random_tiny_vlm_dir, arithmetic_data_dir, fresh_vlm_server, weights_root, tmp_path
):
    server = fresh_vlm_server()
    run_dir = tmp_path / "run"
    run = run_cli([
        "train", f"model.name_or_path={random_tiny_vlm_dir}", f"data.path={arithmetic_data_dir / 'train.jsonl'}",
        "data.eval_path=null", "reward=length", "packing=tree", "packing.token_budget=512",
        f"trainer.max_steps={STEPS}", "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}",
        "server.launch=false", f"server.base_url={server.base_url}", f"server.weights_dir={weights_root}",
        "trainer.cpu_threads=1",
    ])  # fmt: skip
    assert run.returncode == 0, run.output[-4000:]
    assert wait_no_marked(run.marker) == []
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert steps[-1]["step"] == STEPS
    assert max(s["batch/packing_ratio"] for s in steps if "batch/packing_ratio" in s) > 1.0  # prompts shared

    base = AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir, dtype=torch.float32).state_dict()
    trained_model = AutoModelForImageTextToText.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
    trained = trained_model.state_dict()
    assert trained.keys() == base.keys()
    tower = [k for k in base if k.startswith("model.visual.")]
    assert tower and all(torch.equal(trained[k], base[k]) for k in tower)
    assert any(not torch.equal(trained[k], base[k]) for k in base if ".linear_attn." in k)  # DeltaNet layers trained
    assert (run_dir / "model" / "preprocessor_config.json").is_file()
    assert served_vs_trained(server.base_url, trained_model) <= 1e-4
