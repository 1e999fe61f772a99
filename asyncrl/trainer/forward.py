"""The packed forward: per-token log-probabilities of the trained tokens of one row.

Attention follows the row's segments through a tree attention backend (packing/attention.py). Logits are
computed only at the positions that predict a trained token (``logits_to_keep`` with an index tensor),
scaled by the sampling temperature, and, when the sampler drew from a truncated candidate set
(top-k/top-p/min-p), renormalised over that set as the sampler's processed logprobs were.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from asyncrl.packing.attention import attach_tree_attention, build_plan
from asyncrl.packing.row import PackedRow


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # [T]
    top_logprobs: torch.Tensor | None  # [T, K] for the sampler's top-K ids
    entropy: torch.Tensor  # [T], no grad
    seconds: float


def packed_forward(
    model: torch.nn.Module, row: PackedRow, temperature: float, *, attention: str = "auto"
) -> ForwardOutput:
    """``attention``: the tree attention backend, the packing config's ``attention`` (packing/attention.py)."""
    device = next(model.parameters()).device
    started = time.perf_counter()
    attach_tree_attention(model)
    out = model(
        input_ids=row.input_ids[None].to(device),
        position_ids=row.position_ids[None].to(device),
        logits_to_keep=row.token_index.to(device),
        use_cache=False,
        tree_plan=build_plan(attention, row, device),
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
