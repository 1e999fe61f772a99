"""Checkpoints on disk: a save replaces an existing one without a half-deleted directory under its final name,
leftovers of an interrupted save are never listed, and a resume refuses to interleave two histories."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.trainer.checkpoint import (
    ResumeError,
    TrainerState,
    check_no_later_checkpoints,
    list_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def saver(random_tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def save(output_dir, step: int, limit: int | None = None, prompt_index: int = 0):
        state = TrainerState(step=step, model_version=step, prompt_index=prompt_index, prompts_consumed=0, extra={})
        return save_checkpoint(output_dir, state, model, tokenizer, optimizer, scheduler, limit)

    return save


def test_a_save_over_an_existing_step_replaces_it_whole(saver, tmp_path):
    saver(tmp_path, 5, prompt_index=1)
    root = tmp_path / "checkpoints"
    (root / "step_000007.tmp").mkdir()  # an interrupted save
    (root / "step_000005.old").mkdir()  # an interrupted replacement
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005"]
    final = saver(tmp_path, 5, prompt_index=2)
    assert json.loads((final / "rollout_state.json").read_text())["prompt_index"] == 2
    assert (final / "model.safetensors").is_file() and (final / "optimizer.pt").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["step_000005", "step_000007.tmp"]


def test_a_resume_under_later_checkpoints_is_refused_before_anything_starts(saver, tmp_path):
    for step in (10, 20, 30):
        saver(tmp_path, step, limit=3)
    check_no_later_checkpoints(resolve_checkpoint("latest", tmp_path), tmp_path)
    older = tmp_path / "checkpoints" / "step_000010"
    with pytest.raises(ResumeError, match=r"at step 10 .* later checkpoints \(step_000020, step_000030\)"):
        check_no_later_checkpoints(older, tmp_path)
    check_no_later_checkpoints(older, tmp_path / "elsewhere")  # into a new run directory: nothing to mix with


def test_a_checkpoint_loads_with_weights_only_and_restores_every_rng(saver, random_tiny_model_dir, tmp_path):
    """optimizer.pt and rng_state.pt hold only tensors and plain values: torch.load(weights_only=True) reads them,
    so a checkpoint from someone else cannot run code, and the random streams continue where they were."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = saver(tmp_path, 4, prompt_index=7)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for name in ("optimizer.pt", "rng_state.pt"):
        torch.load(path / name, weights_only=True)
    optimizer = torch.optim.AdamW(AutoModelForCausalLM.from_pretrained(random_tiny_model_dir).parameters())
    state = load_checkpoint(path, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    assert (state.step, state.prompt_index) == (4, 7)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
