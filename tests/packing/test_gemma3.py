"""Gemma 3 in packed rows: sliding-window layers and the final logit softcap, exact against each sample alone.

A tiny random Gemma 3 text model in float64 (window 6, samples of up to 56 tokens) through every CPU-testable
backend, flat and tree rows, compared with each sample forwarded alone by transformers' own SDPA attention at the
tolerances of test_exactness.py; then the trainer's step on a saved checkpoint.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from packing_samples import build_tiny_gemma3, random_samples, reference_varlen
from test_exactness import TEMPERATURE, alone_logprobs, assert_gradients_match, pack
from transformers import Gemma3TextConfig

from asyncrl.components import build_components
from asyncrl.config.compose import compose, to_config
from asyncrl.losses.step import StepLoss
from asyncrl.packing import FlatRow, TreeRow
from asyncrl.packing.attention import ATTENTION, cascade_plan, check_model, flex_plan, varlen_plan
from asyncrl.packing.cascade import ReferenceKernel
from asyncrl.trainer.distributed import split_rows, train_rows
from asyncrl.trainer.forward import packed_forward, trainer_forward
from asyncrl.trainer.memory import synthetic_rows
from asyncrl.trainer.model import build_optimizer, load_model

WINDOW = 6
REFERENCE_KERNELS = {
    "varlen": lambda row, dev, window=None: varlen_plan(
        row, dev, kernel=reference_varlen, half_precision=False, window=window
    ),
    "cascade": lambda row, dev, window=None: cascade_plan(row, dev, kernel=ReferenceKernel(), window=window),
}
"""The CUDA backends' plans with plain-torch kernels standing in for flash (the GPU test in test_attention.py
runs the real ones)."""


def models(seed: int, **config):
    packed_model = build_tiny_gemma3(seed, WINDOW, **config)
    reference = copy.deepcopy(packed_model)
    reference.set_attn_implementation("sdpa")
    return packed_model, reference


def gemma_row(seed: int, row_cls=TreeRow):
    """Groups sharing a prompt (and a system prefix), longer than the window: a completion's window reaches
    back into its prompt, and the first tokens of long samples fall out of it."""
    row = pack(random_samples(seed, num_groups=2, max_group=5), row_cls)
    assert max(s.num_tokens for s in row.samples) > 3 * WINDOW
    return row


@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
@pytest.mark.parametrize("attention", ["sdpa", "varlen", "cascade"])
def test_sliding_windows_match_each_sample_alone(attention, row_cls, monkeypatch):
    if attention in REFERENCE_KERNELS:
        monkeypatch.setitem(ATTENTION._entries, attention, REFERENCE_KERNELS[attention])
    row = gemma_row(seed=1, row_cls=row_cls)
    model, reference = models(1)
    packed = packed_forward(model, row, TEMPERATURE, attention=attention).logprobs
    expected = alone_logprobs(reference, row.samples)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    (row.advantages * packed).sum().backward()
    (row.advantages * expected).sum().backward()
    assert_gradients_match(model, reference)


@torch.no_grad()
@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
def test_flex_sliding_window_mask_matches_each_sample_alone(row_cls, monkeypatch):
    """Forward only: flex attention has no backward off CUDA."""
    monkeypatch.setitem(ATTENTION._entries, "flex", lambda row, dev, window=None: flex_plan(row, dev, window=window))
    row = gemma_row(seed=2, row_cls=row_cls)
    model, reference = models(2)
    packed = packed_forward(model, row, TEMPERATURE, attention="flex").logprobs
    torch.testing.assert_close(packed, alone_logprobs(reference, row.samples), atol=1e-5, rtol=0)


def test_final_logit_softcapping_is_applied_as_the_model_does():
    """A cap of 2 (Gemma 2's is 30; Gemma 3's checkpoints set none) bends the logits of this model; logprobs and
    gradients through the chunked head (chunks of 16 tokens) against the model's own capped logits."""
    row = gemma_row(seed=3)
    model, reference = models(3, final_logit_softcapping=2.0)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa", logit_chunk_tokens=16).logprobs
    expected = alone_logprobs(reference, row.samples)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    (row.advantages * packed).sum().backward()
    (row.advantages * expected).sum().backward()
    assert_gradients_match(model, reference)


def test_model_check_refuses_softcapped_and_bidirectional_attention():
    from transformers import Gemma3ForCausalLM

    def tiny(**overrides):
        return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=48, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                  head_dim=8, sliding_window=4, **overrides))  # fmt: skip

    check_model(tiny())
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0, which packed rows do not apply"):
        check_model(tiny(attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="bidirectional attention; packed rows are causal"):
        check_model(tiny(use_bidirectional_attention=True))


def test_the_trainer_steps_a_saved_gemma3_checkpoint(tmp_path, one_rank):
    """Loaded as the trainer loads a checkpoint (its directory's config names Gemma3ForCausalLM), one step's
    forward and backward through tree rows with gradient checkpointing, and an update that moves the weights."""
    build_tiny_gemma3(4, WINDOW).float().save_pretrained(tmp_path)
    config = to_config(compose([f"model.name_or_path={tmp_path}", "packing=tree", "loss=clipped",
                                "trainer.learning_rate=1e-2", "trainer.gradient_checkpointing=true"]))  # fmt: skip
    components = build_components(config)
    model = load_model(config, str(tmp_path))
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.is_activation_checkpointing
    optimizer, _ = build_optimizer(config, model)
    row_factory, _ = components.packer.rows(96)
    rows = synthetic_rows(row_factory, 12, 20, 4, model.config.vocab_size, config.sampling.num_sampler_logprobs)[:1]
    with torch.no_grad():  # on-policy: the sampler's logprobs are the model's
        rows[0].sampler_logprobs = trainer_forward(model, rows[0], config).logprobs.float()
    loss = StepLoss(components.loss, components.advantage, 20)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.train()
    result = train_rows(model, loss, split_rows(rows, [[0]], loss.norm(rows))[0], one_rank, config)
    assert result.metrics and all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    optimizer.step()
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters())


# ---- GPU: the flash and flex kernels' windows, bf16 ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["varlen", "cascade", "flex", "kernels"])
def test_gpu_backends_with_sliding_windows_match_each_sample_alone_in_bf16(attention):
    """torch's flash (varlen, cascade: window sizes (window - 1, 0)) and flex (the window in the block mask) on a
    tree row against each sample forwarded alone by transformers' SDPA; every parameter gets a finite gradient."""
    row = pack(random_samples(seed=11))
    model = build_tiny_gemma3(11, WINDOW, head_dim=64, dtype=torch.bfloat16).cuda()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kernels: FA3 from the Hub is out of reach offline, varlen stands in
        out = packed_forward(model, row, TEMPERATURE, attention=attention)
    out.logprobs.sum().backward()
    with torch.no_grad():
        expected = alone_logprobs(reference, row.samples)
    assert (out.logprobs.detach() - expected).abs().max() < 0.05
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
