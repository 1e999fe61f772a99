"""GSPO: one importance ratio per sequence (the length-normalised likelihood ratio), clipped as in PPO."""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.losses.base import LOSSES, clip_metrics
from asyncrl.losses.policy import PolicyView, Terms, policy_loss


def sequence_objective(view: PolicyView, epsilon: float, epsilon_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """[S] GSPO loss -min(s A, clip(s, 1 - epsilon, 1 + epsilon_high) A), s = exp(mean_t log r_t) over kept
    slots, and the clip_ratio/* metrics of its sequences (each sequence's flag on all its slots)."""
    if not 0 <= epsilon < 1 or epsilon_high < 0:
        raise ValueError(
            f"GSPO-style losses need 0 <= epsilon < 1 and epsilon_high >= 0, got {epsilon} and {epsilon_high}"
        )
    ratio = view.sequence_mean(view.log_ratio).exp()
    advantages = view.sequence_mean(view.advantages)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
    detached = ratio.detach()
    low = view.keep & ((detached < 1 - epsilon) & (advantages < 0))[view.slot]
    high = view.keep & ((detached > 1 + epsilon_high) & (advantages > 0))[view.slot]
    return loss, clip_metrics(low, high, view.batch)


@LOSSES.register("gspo")
@policy_loss(importance_sampling="none", normalization="sequence")
def gspo_loss(view: PolicyView, *, epsilon: float = 3e-4, epsilon_high: float = 4e-4) -> Terms:
    """GSPO (Qwen, arXiv 2507.18071): s_i = (pi_theta(o_i) / mu(o_i))^(1/|o_i|), sequence loss
    -min(s_i A_i, clip(s_i, 1 - epsilon, 1 + epsilon_high) A_i) placed on each of its slots.

    With the default normalization=sequence the step loss is the paper's mean over sequences; the default
    clip range is the paper's 3e-4 / 4e-4 (a geometric-mean ratio moves far less than a token ratio).
    """
    loss, metrics = sequence_objective(view, epsilon, epsilon_high)
    return Terms(loss=loss[view.slot], metrics=metrics)
