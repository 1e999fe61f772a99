"""SAPO: a soft, temperature-controlled sigmoid gate on the ratio instead of PPO's hard clip."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.losses.base import clip_metrics
from asyncrl.losses.policy import LOSSES, PolicyLoss, PolicyView, SequenceOptions, Terms


@dataclass(frozen=True)
class SapoOptions(SequenceOptions):
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"loss 'sapo' needs tau_pos > 0 and tau_neg > 0, got {self.tau_pos} and {self.tau_neg}")


@LOSSES.register("sapo")
class Sapo(PolicyLoss):
    """SAPO (Qwen, arXiv 2511.20347; formula as in grpo_trainer.md).

    Per slot: -f(r) A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg.
    f'(1) = 1, so on-policy this is the plain policy gradient; the gradient weight 4 sigma (1 - sigma) r
    fades smoothly as r leaves 1, faster for A <= 0 when tau_neg > tau_pos. The paper averages per
    sequence, hence normalization=sequence by default. Nothing is clipped, so clip_ratio/* are 0.
    """

    Options = SapoOptions
    options: SapoOptions

    def terms(self, view: PolicyView) -> Terms:
        tau = torch.full_like(view.log_ratio, self.options.tau_neg).masked_fill(view.advantages > 0,
                                                                                 self.options.tau_pos)  # fmt: skip
        gate = torch.sigmoid(tau * (view.log_ratio.exp() - 1)) * 4 / tau
        none = torch.zeros_like(view.keep)
        return Terms(loss=-gate * view.advantages, metrics=clip_metrics(none, none, view.batch))
