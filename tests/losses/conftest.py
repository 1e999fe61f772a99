"""Batch builders shared by the loss tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from asyncrl.losses import LOSSES, LossBatch, LossOutput


def build_batch(
    logprobs: Sequence[float],
    sampler_logprobs: Sequence[float],
    advantages: Sequence[float],
    mask: Sequence[float],
    sequence_index: Sequence[int] | None = None,
    top_logprobs: Sequence[Sequence[float]] | None = None,
    sampler_top_logprobs: Sequence[Sequence[float]] | None = None,
    dtype: torch.dtype = torch.float64,
    entropy: Sequence[float] | None = None,
    truncated: Sequence[bool] | None = None,
    ref_logprobs: Sequence[float] | None = None,
) -> LossBatch:
    """A LossBatch from plain lists; trainer-side tensors require grad (entropy does not: the trainer's has none)."""

    def tensor(values, grad=False):
        return None if values is None else torch.tensor(values, dtype=dtype, requires_grad=grad)

    index = list(range(len(logprobs))) if sequence_index is None else sequence_index
    return LossBatch(
        logprobs=tensor(logprobs, grad=True),
        sampler_logprobs=tensor(sampler_logprobs),
        advantages=tensor(advantages),
        mask=tensor(mask),
        sequence_index=torch.tensor(index, dtype=torch.long),
        top_logprobs=tensor(top_logprobs, grad=True),
        sampler_top_logprobs=tensor(sampler_top_logprobs),
        entropy=tensor(entropy),
        truncated=None if truncated is None else torch.tensor(truncated, dtype=torch.bool),
        ref_logprobs=tensor(ref_logprobs),
    )


def run_loss(name: str, batch: LossBatch, **options) -> LossOutput:
    """The registered loss ``name`` built with ``options`` (as YAML sets them), on ``batch``."""
    return LOSSES.build({"name": name, **options})(batch)


@pytest.fixture
def make_batch() -> Callable[..., LossBatch]:
    return build_batch


def softmax_policy_batch(
    logits: torch.Tensor,
    sampler_logits: torch.Tensor,
    tokens: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    top_k: int,
) -> LossBatch:
    """A batch whose logprobs come from ``logits`` [T, V] (so gradients reach them) and the sampler's top-K ids."""
    logp = torch.log_softmax(logits, dim=-1)
    sampler_logp = torch.log_softmax(sampler_logits, dim=-1)
    top_ids = sampler_logp.topk(top_k, dim=-1).indices
    return LossBatch(
        logprobs=logp.gather(-1, tokens[:, None]).squeeze(-1),
        sampler_logprobs=sampler_logp.gather(-1, tokens[:, None]).squeeze(-1),
        advantages=advantages,
        mask=mask,
        sequence_index=torch.arange(len(tokens)) // 3,
        top_logprobs=logp.gather(-1, top_ids),
        sampler_top_logprobs=sampler_logp.gather(-1, top_ids),
    )


@pytest.fixture
def make_policy_batch() -> Callable[..., LossBatch]:
    return softmax_policy_batch


def random_sequences(seed: int, num_sequences: int = 7, max_length: int = 6, extreme: bool = True) -> dict:
    """Float64 numpy inputs of several sequences: per-sequence advantages, ~15% padding slots (NaN advantage
    and entropy, -inf sampler logprob), and with ``extreme`` four slots whose ratio is e^+-8."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, size=num_sequences)
    sequence = np.repeat(np.arange(num_sequences), lengths)
    size = len(sequence)
    sampler = -rng.random(size) * 3 - 0.05
    logprobs = sampler + rng.normal(scale=0.3, size=size)
    if extreme:
        picked = rng.choice(size, size=4, replace=False)
        logprobs[picked] = sampler[picked] + np.array([8.0, -8.0, 8.0, -8.0])
    mask = (rng.random(size) > 0.15).astype(float)
    advantages = rng.normal(size=num_sequences)[sequence]
    entropy = rng.random(size) * 3
    padding = mask == 0
    advantages[padding], entropy[padding], sampler[padding] = np.nan, np.nan, -np.inf
    return {"logprobs": logprobs, "sampler_logprobs": sampler, "advantages": advantages, "mask": mask,
            "sequence_index": sequence, "entropy": entropy}  # fmt: skip


def batch_of(
    inputs: dict, truncated: Sequence[bool] | None = None, ref_logprobs: np.ndarray | None = None
) -> LossBatch:
    return build_batch(
        inputs["logprobs"].tolist(), inputs["sampler_logprobs"].tolist(), inputs["advantages"].tolist(),
        inputs["mask"].tolist(), inputs["sequence_index"].tolist(), entropy=inputs["entropy"].tolist(),
        truncated=truncated, ref_logprobs=None if ref_logprobs is None else ref_logprobs.tolist(),
    )  # fmt: skip


def assert_float64_close(actual: torch.Tensor, expected) -> None:
    """The issue's bar: float64 values at most 1e-10 apart."""
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float64), rtol=0, atol=1e-10)


def kept_sequences(inputs: dict):
    """(slots, advantage) of each sequence that keeps a token: the loop of the float64 sequence-level references."""
    seq, mask, adv = inputs["sequence_index"], inputs["mask"], inputs["advantages"]
    for i in np.unique(seq):
        slots = np.flatnonzero((seq == i) & (mask > 0))
        if slots.size:
            yield slots, adv[slots[0]]


def sequence_clip_reference(inputs: dict, epsilon: float, epsilon_high: float, by_length: bool):
    """GSPO (LUSPO with ``by_length``: each sequence's loss times its length) in float64: value and d/d logprob,
    whose per-slot part is the sequence's d/ds times ds/dlogprob = s/|o|."""
    lp, mu = inputs["logprobs"], inputs["sampler_logprobs"]
    value, grad = 0.0, np.zeros(len(lp))
    for slots, a in kept_sequences(inputs):
        n = slots.size
        s = float(np.exp(sum(lp[t] - mu[t] for t in slots) / n))
        unclipped, clipped = s * a, min(max(s, 1 - epsilon), 1 + epsilon_high) * a
        scale = n if by_length else 1.0
        value -= scale * min(unclipped, clipped)
        if unclipped <= clipped:
            grad[slots] = -scale * a * s / n
    return value, grad
