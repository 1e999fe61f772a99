"""The KL penalty's reference model: none at beta 0, the base with the adapters off under LoRA (no second copy), else
a frozen sharded copy of the initial weights that loss.sync_ref_model mixes the policy into (TR-DPO)."""

from __future__ import annotations

from pathlib import Path

import torch
from sharded import sharded
from transformers import AutoModelForCausalLM

from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.losses import LOSSES
from asyncrl.packing.flat import FlatRow
from asyncrl.packing.row import PackedRow
from asyncrl.rollout.types import RolloutSample, TrainingSequence
from asyncrl.trainer.forward import packed_forward, trainer_forward
from asyncrl.trainer.model import load_model
from asyncrl.trainer.reference import build_reference


def config_for(model_dir: Path, *overrides: str) -> Config:
    return to_config(compose([f"model.name_or_path={model_dir}", "loss=clipped", *overrides]))


def packed_row() -> PackedRow:
    """One sample: three prompt tokens and five trained ones."""
    sequence = TrainingSequence(token_ids=[3, 4, 5, 6, 7, 8, 9, 10], mask=[0, 0, 0, 1, 1, 1, 1, 1],
                                sampler_logprobs=[0.0] * 3 + [-1.0] * 5)  # fmt: skip
    row = FlatRow(token_budget=64)
    row.add(RolloutSample(sequence=sequence, advantage=1.0, reward=1.0, group_id=0, row_index=0, prompt_index=0,
                          model_version=0, rollout_id="a"))  # fmt: skip
    return row.pack(0)


def test_no_reference_without_a_kl_penalty(random_tiny_model_dir):
    config = config_for(random_tiny_model_dir)
    assert build_reference(config, torch.nn.Linear(1, 1), LOSSES.build(config.loss).options) is None


def test_under_lora_the_reference_is_the_base_with_the_adapters_off(random_tiny_model_dir):
    config = config_for(random_tiny_model_dir, "lora=default", "lora.r=8", "loss.beta=0.1")
    policy = load_model(config, str(random_tiny_model_dir))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained adapters (lora_B starts at zero, which would change nothing)
        for param in (p for p in policy.parameters() if p.requires_grad):
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    reference = build_reference(config, policy, LOSSES.build(config.loss).options)
    assert reference is not None and reference.model is None  # no second copy of the weights
    row = packed_row()
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    expected = packed_forward(base, row, config.sampling.temperature).logprobs
    torch.testing.assert_close(reference.logprobs(row, config), expected)
    policy_logprobs = trainer_forward(policy, row, config).logprobs  # the adapters are on again after it
    assert (policy_logprobs - expected).abs().max() > 1e-3


def test_a_full_reference_is_a_frozen_copy_that_sync_ref_model_mixes_every_n_steps(random_tiny_model_dir, one_rank):
    config = config_for(random_tiny_model_dir, "loss.beta=0.1", "loss.sync_ref_model=true",
                        "loss.ref_model_mixup_alpha=0.25", "loss.ref_model_sync_steps=2")  # fmt: skip
    policy, _, _ = sharded(config, load_model(config, str(random_tiny_model_dir)))
    reference = build_reference(config, policy, LOSSES.build(config.loss).options)
    assert reference is not None and reference.model is not None
    assert not any(p.requires_grad for p in reference.model.parameters())
    initial = [p.detach().to_local().clone() for p in reference.model.parameters()]
    with torch.no_grad():  # the policy trains away from the reference
        for param in policy.parameters():
            param.add_(1.0)
    reference.end_step()  # step 1 of ref_model_sync_steps=2: left alone
    assert all(torch.equal(p.to_local(), q) for p, q in zip(reference.model.parameters(), initial, strict=True))
    reference.end_step()  # step 2: ref = 0.25 * policy + 0.75 * ref
    for ref, param, before in zip(reference.model.parameters(), policy.parameters(), initial, strict=True):
        torch.testing.assert_close(ref.to_local(), 0.25 * param.detach().to_local() + 0.75 * before)


def test_a_full_reference_scores_as_the_initial_model_whatever_the_policy_becomes(random_tiny_model_dir, one_rank):
    config = config_for(random_tiny_model_dir, "loss.beta=0.1")
    policy, _, _ = sharded(config, load_model(config, str(random_tiny_model_dir)))
    reference = build_reference(config, policy, LOSSES.build(config.loss).options)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.5)
    row = packed_row()
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    logprobs = reference.logprobs(row, config)
    assert not logprobs.requires_grad
    torch.testing.assert_close(logprobs, packed_forward(base, row, config.sampling.temperature).logprobs)
