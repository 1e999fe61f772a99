"""CISPO: clip the importance weight, never the update, so every token keeps a gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.losses.base import clip_metrics, masked_mean
from asyncrl.losses.policy import LOSSES, ImportanceSampling, PolicyLoss, PolicyOptions, PolicyView, Terms


@dataclass(frozen=True)
class CispoOptions(PolicyOptions):
    importance_sampling: ImportanceSampling = ImportanceSampling.none
    epsilon_high: float = 5.0
    """ScaleRL's epsilon_max: the cap on the importance weight."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.epsilon_high > 0:
            raise ValueError(f"loss 'cispo' needs epsilon_high > 0 (the cap on the importance weight), "
                             f"got {self.epsilon_high}")  # fmt: skip


@LOSSES.register("cispo")
class Cispo(PolicyLoss):
    """CISPO (MiniMax-M1, arXiv 2506.13585), with ScaleRL's epsilon_max as ``epsilon_high``.

    Per slot: -sg(min(r, epsilon_high)) A log pi_theta(o_t), r = pi_theta / mu. The weight is detached and
    capped, so its gradient is min(r, epsilon_high) A grad log pi: no token is flattened away by a clip.
    cispo_clip_ratio and clip_ratio/high_* count kept slots with r > epsilon_high and A > 0 (TRL's
    definition); nothing is clipped low.
    """

    Options = CispoOptions
    options: CispoOptions

    def terms(self, view: PolicyView) -> Terms:
        epsilon_high = self.options.epsilon_high
        ratio = view.log_ratio.detach().exp()
        high = view.keep & (ratio > epsilon_high) & (view.advantages > 0)
        metrics = clip_metrics(torch.zeros_like(high), high, view.batch)
        metrics["cispo_clip_ratio"] = masked_mean(high.to(ratio.dtype), view.batch.mask > 0)
        return Terms(loss=-ratio.clamp(max=epsilon_high) * view.advantages * view.logprobs, metrics=metrics)
