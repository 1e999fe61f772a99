"""The packing invariant: a trained token's log-probability (and its gradient) is the one its sample gets alone.

Random tries (groups of 2-16 rollouts sharing prompts, a system prefix shared across groups, forking multi-turn
samples) on a tiny random Qwen3 in float32 on CPU, compared with each sample forwarded alone by transformers'
own SDPA attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
from packing_samples import build_tiny_qwen3, random_samples, reference_varlen

from asyncrl.packing import FlatRow, TreeRow
from asyncrl.packing.attention import ATTENTION, cascade_plan, flex_plan, varlen_plan
from asyncrl.packing.cascade import ReferenceKernel
from asyncrl.trainer.forward import packed_forward

TEMPERATURE = 0.8


def pack(samples, row_cls=TreeRow):
    row = row_cls(10_000)
    for sample in samples:
        row.add(sample)
    return row.pack(top_k=0)


def alone_logprobs(model, samples) -> torch.Tensor:
    """Each sample forwarded by itself with plain causal SDPA, in the row's loss-slot order (on the model's
    device, in float32 at least)."""
    out = []
    for sample in samples:
        tokens = torch.tensor(sample.sequence.token_ids, device=model.device)
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / TEMPERATURE
        logprobs = logits.log_softmax(-1)[:-1].gather(1, tokens[1:, None]).squeeze(1)
        out.append(logprobs[torch.tensor(sample.sequence.mask[1:], dtype=torch.bool, device=model.device)])
    return torch.cat(out)


def models(seed: int):
    packed_model = build_tiny_qwen3(seed)
    reference = copy.deepcopy(packed_model)
    reference.set_attn_implementation("sdpa")
    return packed_model, reference


def assert_gradients_match(model, reference, rtol=1e-4):
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = grads[name].grad
        scale = expected.abs().max().clamp_min(1e-8)
        assert (param.grad - expected).abs().max() <= rtol * scale, name


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tree_packing_matches_per_sample_logprobs_and_gradients(seed):
    samples = random_samples(seed)
    row = pack(samples)
    assert row.num_forwarded < row.num_raw_tokens  # something is shared
    model, reference = models(seed)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    expected = alone_logprobs(reference, row.samples)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    (row.advantages * packed).sum().backward()
    (row.advantages * expected).sum().backward()
    assert_gradients_match(model, reference)


def test_flat_rows_take_the_same_path():
    samples = random_samples(seed=5, num_groups=2)
    row = pack(samples, FlatRow)
    model, reference = models(5)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    torch.testing.assert_close(packed, alone_logprobs(reference, row.samples), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [6, 7])
def test_varlen_gather_of_segment_paths_is_exact(seed, monkeypatch):
    """The varlen plan (K/V gathered along each path, one call) with a reference kernel standing in for CUDA's."""
    monkeypatch.setitem(
        ATTENTION._entries,
        "varlen",
        lambda row, dev: varlen_plan(row, dev, kernel=reference_varlen, half_precision=False),
    )
    row = pack(random_samples(seed))
    model, reference = models(seed)
    packed = packed_forward(model, row, TEMPERATURE, attention="varlen").logprobs
    expected = alone_logprobs(reference, row.samples)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    (row.advantages * packed).sum().backward()
    (row.advantages * expected).sum().backward()
    assert_gradients_match(model, reference)


def test_cascade_merge_matches_the_mask_in_the_model(monkeypatch):
    """The per-depth parts and their log-sum-exp merge, with the reference kernel standing in for flash, against
    the sdpa plan on the same row (random tries fork up to depth 6), logprobs and parameter gradients."""
    monkeypatch.setitem(
        ATTENTION._entries, "cascade", lambda row, dev: cascade_plan(row, dev, kernel=ReferenceKernel())
    )
    row = pack(random_samples(seed=3))
    model, masked = models(3)
    packed = packed_forward(model, row, TEMPERATURE, attention="cascade").logprobs
    expected = packed_forward(masked, row, TEMPERATURE, attention="sdpa").logprobs
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    (row.advantages * packed).sum().backward()
    (row.advantages * expected).sum().backward()
    assert_gradients_match(model, masked, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("bucket", [1, 64])
def test_flex_block_mask_from_the_ancestor_relation_is_exact(bucket, monkeypatch):
    """bucket 64: the row padded as on CUDA, where pad tokens must neither see nor be seen."""
    monkeypatch.setitem(ATTENTION._entries, "flex", lambda row, dev: flex_plan(row, dev, bucket=bucket))
    row = pack(random_samples(seed=8))
    assert row.num_forwarded % 64 != 0
    model, reference = models(8)
    packed = packed_forward(model, row, TEMPERATURE, attention="flex").logprobs
    torch.testing.assert_close(packed, alone_logprobs(reference, row.samples), atol=1e-5, rtol=0)


def test_gradient_checkpointing_passes_the_plan_through():
    row = pack(random_samples(seed=9, num_groups=2))
    model = build_tiny_qwen3(9)
    plain = copy.deepcopy(model)
    model.gradient_checkpointing_enable()
    model.train(), plain.train()
    (row.advantages * packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs).sum().backward()
    (row.advantages * packed_forward(plain, row, TEMPERATURE, attention="sdpa").logprobs).sum().backward()
    assert_gradients_match(model, plain, rtol=1e-5)
