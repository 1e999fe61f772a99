"""Batch builders shared by the loss tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from asyncrl.losses import LossBatch


def build_batch(
    logprobs: Sequence[float],
    sampler_logprobs: Sequence[float],
    advantages: Sequence[float],
    mask: Sequence[float],
    sequence_index: Sequence[int] | None = None,
    top_logprobs: Sequence[Sequence[float]] | None = None,
    sampler_top_logprobs: Sequence[Sequence[float]] | None = None,
    dtype: torch.dtype = torch.float64,
) -> LossBatch:
    """A LossBatch from plain lists; trainer-side tensors require grad."""

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
    )


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
