"""VESPO: a smooth, asymmetric gamma-shaped weight on each sequence's full importance ratio."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.losses.base import clip_metrics, masked_mean
from asyncrl.losses.policy import LOSSES, ImportanceSampling, PolicyLoss, PolicyOptions, PolicyView, Terms

LOG_WEIGHT_BOUND = 50.0


@dataclass(frozen=True)
class VespoOptions(PolicyOptions):
    importance_sampling: ImportanceSampling = ImportanceSampling.none
    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.k_pos, self.k_neg) < 0 or min(self.lambda_pos, self.lambda_neg) <= 0:
            raise ValueError(f"loss 'vespo' needs k >= 0 and lambda > 0, got k={self.k_pos}/{self.k_neg}, "
                             f"lambda={self.lambda_pos}/{self.lambda_neg}")  # fmt: skip


@LOSSES.register("vespo")
class Vespo(PolicyLoss):
    """VESPO (Xiaohongshu, arXiv 2602.10693): REINFORCE weighted by phi(w_i) of the sequence ratio.

    w_i = prod_t r_t over the sequence's kept slots (no length normalisation), phi(w) = w^k exp(lambda (1 - w)),
    so phi(1) = 1, phi peaks at w = k / lambda and vanishes as w -> 0 or w -> inf; (k, lambda) = (k_pos,
    lambda_pos) when A >= 0, else (k_neg, lambda_neg). Per slot: -sg(phi(w_i)) A log pi_theta(o_t).
    log w is clamped to +-50 before phi, where phi is below 1e-20 for every allowed k, lambda.
    vespo/phi_seq_mean is the mean phi over sequences with kept slots; clip_ratio/* are 0.
    """

    Options = VespoOptions
    options: VespoOptions

    def terms(self, view: PolicyView) -> Terms:
        o = self.options
        log_weight = view.sequence_sum(view.log_ratio.detach()).clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
        positive = view.sequence_mean(view.advantages) >= 0
        k = torch.full_like(log_weight, o.k_neg).masked_fill(positive, o.k_pos)
        lam = torch.full_like(log_weight, o.lambda_neg).masked_fill(positive, o.lambda_pos)
        phi = torch.exp(k * log_weight + lam * (1 - log_weight.exp()))
        none = torch.zeros_like(view.keep)
        metrics = clip_metrics(none, none, view.batch)
        metrics["vespo/phi_seq_mean"] = masked_mean(phi, view.sequence_sum(torch.ones_like(view.logprobs)) > 0)
        return Terms(loss=-phi[view.slot] * view.advantages * view.logprobs, metrics=metrics)
