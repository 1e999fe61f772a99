"""GSPO: one importance ratio per sequence (the length-normalised likelihood ratio), clipped as in PPO."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.losses.base import clip_metrics
from asyncrl.losses.policy import LOSSES, PolicyLoss, PolicyView, SequenceOptions, Terms


@dataclass(frozen=True)
class GspoOptions(SequenceOptions):
    """GSPO's and LUSPO's options: no token correction and the mean over sequences by default, and the paper's
    clip range (a geometric-mean ratio moves far less than a token ratio)."""

    epsilon: float = 3e-4
    epsilon_high: float = 4e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.epsilon < 1 or self.epsilon_high < 0:
            raise ValueError(f"GSPO-style losses need 0 <= epsilon < 1 and epsilon_high >= 0, got {self.epsilon} "
                             f"and {self.epsilon_high}")  # fmt: skip


def sequence_objective(view: PolicyView, epsilon: float, epsilon_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """[S] GSPO loss -min(s A, clip(s, 1 - epsilon, 1 + epsilon_high) A), s = exp(mean_t log r_t) over kept
    slots, and the clip_ratio/* metrics of its sequences (each sequence's flag on all its slots)."""
    ratio = view.sequence_mean(view.log_ratio).exp()
    advantages = view.sequence_mean(view.advantages)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
    detached = ratio.detach()
    low = view.keep & ((detached < 1 - epsilon) & (advantages < 0))[view.slot]
    high = view.keep & ((detached > 1 + epsilon_high) & (advantages > 0))[view.slot]
    return loss, clip_metrics(low, high, view.batch)


@LOSSES.register("gspo")
class Gspo(PolicyLoss):
    """GSPO (Qwen, arXiv 2507.18071): s_i = (pi_theta(o_i) / mu(o_i))^(1/|o_i|), sequence loss
    -min(s_i A_i, clip(s_i, 1 - epsilon, 1 + epsilon_high) A_i) placed on each of its slots.

    With the default normalization=sequence the step loss is the paper's mean over sequences; the default
    clip range is the paper's 3e-4 / 4e-4.
    """

    Options = GspoOptions
    options: GspoOptions

    def terms(self, view: PolicyView) -> Terms:
        loss, metrics = sequence_objective(view, self.options.epsilon, self.options.epsilon_high)
        return Terms(loss=loss[view.slot], metrics=metrics)
