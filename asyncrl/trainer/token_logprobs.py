"""Per-token log-probabilities from final hidden states, a chunk of tokens at a time (called by trainer/forward.py).

The LM head's [tokens x vocabulary] logits (152k columns for Qwen3) are the largest tensors of a step. Here only
[chunk x vocabulary] exists at once: the forward keeps each token's log-normaliser, and the backward recomputes
its chunk's logits to form d(loss)/d(logits) and pushes it into the hidden states and the head's weight.
Gemma's final logit softcapping, temperature scaling and renormalisation over a sampler's candidate set are applied
exactly as the sampler did.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.trainer import compile_options

LOGIT_CHUNK_BYTES = 1 << 30
"""A chunk's float32 [tokens x vocabulary] buffer at most, where trainer.logit_chunk_tokens is null: 1,024 tokens at
Gemma 3's 262k vocabulary, 1,081 at Qwen3.5's 248k, 1,766 at Qwen3's 152k. A fixed 4,096 tokens made 4 GiB buffers at
Gemma 3's vocabulary, and one of them no longer fit beside vLLM mid-run (RESULTS.md, session 39)."""


@dataclass
class CandidateSets:
    """Truncated sampling supports as (slot, token id) pairs sorted by slot; slots without a set keep the vocabulary."""

    slots: torch.Tensor  # [N] long
    token_ids: torch.Tensor  # [N] long
    restricted: torch.Tensor  # [T] bool
    bounds: list[int]
    """Where each chunk's pairs begin in ``slots`` (and, last, N)."""

    @classmethod
    def build(cls, sets: list[list[int] | None], chunk_starts: list[int], device: torch.device) -> CandidateSets:
        slots = [slot for slot, ids in enumerate(sets) if ids is not None for _ in ids]
        ids = [token for candidates in sets if candidates is not None for token in candidates]
        restricted = torch.tensor([ids is not None for ids in sets], dtype=torch.bool)
        return cls(
            torch.tensor(slots, dtype=torch.long).to(device),
            torch.tensor(ids, dtype=torch.long).to(device),
            restricted.to(device),
            [bisect.bisect_left(slots, start) for start in chunk_starts],
        )

    def keep(self, index: int, lo: int, hi: int, vocab: int) -> torch.Tensor:
        """[hi - lo, vocab] bool: the candidate set of each slot of chunk ``index`` (all for unrestricted slots)."""
        keep = (~self.restricted[lo:hi])[:, None].repeat(1, vocab)
        first, last = self.bounds[index], self.bounds[index + 1]
        keep[self.slots[first:last] - lo, self.token_ids[first:last]] = True
        return keep


def chunk_stats(
    logits: torch.Tensor,
    keep: torch.Tensor | None,
    targets: torch.Tensor,
    top_ids: torch.Tensor,
    temperature: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """One chunk's log-normaliser, target and top-K log-probabilities and entropy, from its raw head output
    (consumed: the float passes run in place, so eagerly at most three [chunk x vocabulary] buffers exist)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    if keep is not None:
        z.masked_fill_(~keep, float("-inf"))
    log_z = torch.logsumexp(z, dim=-1)
    logp = z.sub_(log_z[:, None])
    plogp = logp.exp().mul_(logp)
    if keep is not None:
        plogp.masked_fill_(~keep, 0.0)  # 0 * -inf outside the set
    return log_z, logp.gather(1, targets[:, None]).squeeze(1), logp.gather(1, top_ids), -plogp.sum(-1)


def chunk_grad_logits(
    logits: torch.Tensor,
    keep: torch.Tensor | None,
    log_z: torch.Tensor,
    targets: torch.Tensor,
    top_ids: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_top: torch.Tensor,
    temperature: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """d(loss)/d(raw head output) of one chunk, in its dtype: sum_j g_j (onehot(id_j) - p) / temperature, zero
    outside the set, times the softcap's derivative 1 - tanh^2 (``logits`` consumed as in chunk_stats)."""
    z = logits.to(log_z.dtype)
    capped = None
    if softcap is not None:
        capped = z.div_(softcap).tanh_()
        z = capped * softcap
    if temperature != 1.0:
        z.div_(temperature)
    grad_z = z.sub_(log_z[:, None]).exp_()  # probabilities (outside the set: zeroed below)
    grad_z.mul_(-(grad_logprobs + grad_top.sum(1))[:, None])
    grad_z.scatter_add_(1, targets[:, None], grad_logprobs[:, None].to(grad_z.dtype))
    grad_z.scatter_add_(1, top_ids, grad_top.to(grad_z.dtype))
    if keep is not None:
        grad_z.masked_fill_(~keep, 0.0)
    if temperature != 1.0:
        grad_z.div_(temperature)
    if capped is not None:
        grad_z.mul_(capped.square_().neg_().add_(1.0))
    return grad_z.to(logits.dtype)


@functools.cache
def _compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """One compiled kernel set per epilogue: the float32 passes over [chunk x vocabulary] fuse into a few. The
    chunk's slices of the row's tensors (targets, top ids, gradients) go in as tensors of their own: as views they
    carry the row's length as their base's, which torch.compile's duck sizing equated with the chunk's when the first
    row was one chunk, so the first row of two compiled both epilogues again mid-run (10-30 s on the GPU)."""
    compiled = torch.compile(fn, dynamic=True, backend=backend, options=compile_options.inductor_options(backend))

    def call(*args: Any) -> Any:
        return compiled(*(a.clone() if isinstance(a, torch.Tensor) and a._base is not None else a for a in args))

    return call


@dataclass
class Chunking:
    """What forward and backward share: the chunks, the candidate sets, the matmul dtype and the epilogues."""

    size: int
    temperature: float
    compute_dtype: torch.dtype
    sets: CandidateSets | None
    compile_backend: str | None = None
    """torch.compile backend of the epilogues (None = eager)."""
    softcap: float | None = None
    """The model's final_logit_softcapping: logits become softcap * tanh(logits / softcap) before the rest."""

    @property
    def float_dtype(self) -> torch.dtype:
        """float32 for the log-softmax (float64 only when the head computes in float64)."""
        return torch.promote_types(self.compute_dtype, torch.float32)

    def epilogue(self, fn: Callable[..., Any], tokens: int) -> Callable[..., Any]:
        """``fn`` compiled for a chunk of ``tokens``, or eager for a chunk of one token: torch.compile specialises
        sizes 0 and 1 even with dynamic=True, so the one-token chunk of a row whose trained tokens are a multiple
        of the chunk size plus one (or of a row of one trained token) would compile both epilogues a second time
        mid-run (guard ``2 <= logits.size()[0]``; 10-30 s on the GPU); one token costs nothing eagerly."""
        return fn if self.compile_backend is None or tokens < 2 else _compiled(fn, self.compile_backend)

    def ranges(self, length: int) -> list[tuple[int, int, int]]:
        """(chunk index, lo, hi) over ``length`` tokens."""
        return [(i, lo, min(lo + self.size, length)) for i, lo in enumerate(range(0, length, self.size))]

    def logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, index: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk's raw head output (compute dtype) and its candidate mask (None: whole vocabulary)."""
        dtype = self.compute_dtype
        z = F.linear(hidden[lo:hi].to(dtype), weight, None if bias is None else bias.to(dtype))
        if self.sets is None:
            return z, None
        return z, self.sets.keep(index, lo, hi, z.shape[1])


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden [T, D], weight [V, D], bias) -> target logprobs [T], top-K logprobs [T, K], entropy [T] (no grad)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        top_ids: torch.Tensor,
        chunking: Chunking,
    ) -> tuple[torch.Tensor, ...]:
        length = hidden.shape[0]
        w = weight.to(chunking.compute_dtype)
        log_z = hidden.new_empty(length, dtype=chunking.float_dtype)
        logprobs, entropy = torch.empty_like(log_z), torch.empty_like(log_z)
        top = hidden.new_empty(top_ids.shape, dtype=chunking.float_dtype)
        for index, lo, hi in chunking.ranges(length):
            z, keep = chunking.logits(hidden, w, bias, index, lo, hi)
            log_z[lo:hi], logprobs[lo:hi], top[lo:hi], entropy[lo:hi] = chunking.epilogue(chunk_stats, hi - lo)(
                z, keep, targets[lo:hi], top_ids[lo:hi], chunking.temperature, chunking.softcap
            )
        ctx.save_for_backward(hidden, weight, bias, targets, top_ids, log_z)
        ctx.chunking = chunking
        ctx.mark_non_differentiable(entropy)
        return logprobs, top, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_top: torch.Tensor | None, _grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, top_ids, log_z = ctx.saved_tensors
        chunking: Chunking = ctx.chunking
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_logprobs = torch.zeros_like(log_z) if grad_logprobs is None else grad_logprobs
        grad_top = torch.zeros_like(top_ids, dtype=log_z.dtype) if grad_top is None else grad_top
        dtype = chunking.compute_dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=accumulate, device=weight.device) if need_bias else None
        for index, lo, hi in chunking.ranges(hidden.shape[0]):
            z, keep = chunking.logits(hidden, w, bias, index, lo, hi)
            grad_z = chunking.epilogue(chunk_grad_logits, hi - lo)(
                z,
                keep,
                log_z[lo:hi],
                targets[lo:hi],
                top_ids[lo:hi],
                grad_logprobs[lo:hi],
                grad_top[lo:hi],
                chunking.temperature,
                chunking.softcap,
            )
            if grad_hidden is not None:
                grad_hidden[lo:hi] = grad_z @ w
            if grad_weight is not None:
                grad_weight += grad_z.T @ hidden[lo:hi].to(dtype)
            if grad_bias is not None:
                grad_bias += grad_z.sum(0)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [T]
    top_logprobs: torch.Tensor | None  # [T, K]
    entropy: torch.Tensor  # [T], no grad


def compute_token_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float,
    *,
    top_ids: torch.Tensor | None = None,
    sampling_masks: list[list[int] | None] | None = None,
    chunk_tokens: int | None = None,
    compute_dtype: torch.dtype | None = None,
    compile_backend: str | None = None,
    softcap: float | None = None,
) -> TokenLogprobs:
    """log softmax(head(hidden) / temperature) at ``targets`` (and ``top_ids``), renormalised over each slot's
    candidate set; ``chunk_tokens``: tokens a chunk (0 = all in one; None = as many as LOGIT_CHUNK_BYTES holds at
    the head's vocabulary); ``compute_dtype``: the head matmul's dtype (the autocast dtype the model ran under;
    default the weight's); ``compile_backend``: torch.compile the per-chunk epilogues with it (None = eager);
    ``softcap``: the model's final_logit_softcapping (None: none)."""
    if chunk_tokens is not None and chunk_tokens < 0:
        raise ValueError(f"logit_chunk_tokens={chunk_tokens} must be >= 0 (0 = all trained tokens at once)")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    weight, bias = head.weight, getattr(head, "bias", None)
    device, length = hidden.device, hidden.shape[0]
    if chunk_tokens is None:
        chunk_tokens = max(1, LOGIT_CHUNK_BYTES // (weight.shape[0] * 4))
    size = chunk_tokens or max(length, 1)
    starts = [*range(0, length, size), length]
    sets = CandidateSets.build(sampling_masks, starts, device) if sampling_masks is not None else None
    chunking = Chunking(size, temperature, compute_dtype or weight.dtype, sets, compile_backend, softcap)
    ids = top_ids.to(device) if top_ids is not None else torch.zeros(length, 0, dtype=torch.long, device=device)
    logprobs, top, entropy = ChunkedTokenLogprobs.apply(hidden, weight, bias, targets.to(device), ids, chunking)
    return TokenLogprobs(logprobs, top if top_ids is not None else None, entropy)
