"""The packed forward: per-token log-probabilities of the trained tokens of one row.

Logits are computed only at the positions that predict a trained token (``logits_to_keep`` with an
index tensor), scaled by the sampling temperature, and, when the sampler drew from a truncated candidate
set (top-k/top-p/min-p), renormalised over that set as the sampler's processed logprobs were.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from asyncrl.packing.row import PackedRow


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # [T]
    top_logprobs: torch.Tensor | None  # [T, K] for the sampler's top-K ids
    entropy: torch.Tensor  # [T], no grad
    seconds: float


def tree_attention_mask(row: PackedRow) -> torch.Tensor:
    """[1, 1, L, L] boolean mask: each segment's queries see their path's keys, causally (bottom-right)."""
    length = row.num_forwarded
    mask = torch.zeros(length, length, dtype=torch.bool)
    for seg in row.segments:
        n_q, n_kv = seg.q_end - seg.q_start, int(seg.kv_index.numel())
        allowed = torch.ones(n_q, n_kv, dtype=torch.bool).tril(diagonal=n_kv - n_q)
        rows = torch.arange(seg.q_start, seg.q_end).unsqueeze(1).expand(n_q, n_kv)
        mask[rows, seg.kv_index.unsqueeze(0).expand(n_q, n_kv)] = allowed
    return mask[None, None]


def packed_forward(model: torch.nn.Module, row: PackedRow, temperature: float) -> ForwardOutput:
    device = next(model.parameters()).device
    started = time.perf_counter()
    out = model(
        input_ids=row.input_ids[None].to(device),
        position_ids=row.position_ids[None].to(device),
        attention_mask=tree_attention_mask(row).to(device),
        logits_to_keep=row.token_index.to(device),
        use_cache=False,
    )
    logits = out.logits[0].float() / temperature  # [T, V]
    if row.sampling_masks is not None:
        logits = _restrict_to_candidates(logits, row.sampling_masks)
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    logprobs_all = logits - log_z
    targets = row.target_ids.to(device)
    logprobs = logprobs_all.gather(1, targets[:, None]).squeeze(1)
    top = None
    if row.top_ids is not None:
        top = logprobs_all.gather(1, row.top_ids.to(device))
    with torch.no_grad():
        probs = logprobs_all.exp()
        entropy = -(probs * torch.where(probs > 0, logprobs_all, torch.zeros_like(logprobs_all))).sum(-1)
    return ForwardOutput(logprobs, top, entropy, time.perf_counter() - started)


def _restrict_to_candidates(logits: torch.Tensor, sets: list[list[int] | None]) -> torch.Tensor:
    """-inf outside each slot's candidate set (slots without a set keep the full vocabulary)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for slot, candidates in enumerate(sets):
        if candidates is not None:
            keep[slot] = False
            keep[slot, torch.tensor(candidates, dtype=torch.long, device=logits.device)] = True
    return logits.masked_fill(~keep, float("-inf"))
