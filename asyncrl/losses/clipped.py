"""The clipped GRPO surrogate with masked importance sampling (the spec's ``score_centering=False`` loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.losses.base import clip_metrics
from asyncrl.losses.policy import LOSSES, PolicyLoss, PolicyOptions, PolicyView, Terms


@dataclass(frozen=True)
class ClippedOptions(PolicyOptions):
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """None: epsilon (a symmetric clip)."""


@LOSSES.register("clipped")
class Clipped(PolicyLoss):
    """DAPO-style asymmetric clip of r = pi_theta / mu_sampler; tokens with r outside the IS bounds are dropped.

    Per trained token: -1[is_clip_min <= r <= is_clip_max] * min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A),
    with epsilon_high = epsilon when None. clip_ratio/* count the tokens whose objective the clip actually
    flattens: r < 1 - epsilon with A < 0 (low) and r > 1 + epsilon_high with A > 0 (high), among kept tokens.
    """

    Options = ClippedOptions
    options: ClippedOptions

    def terms(self, view: PolicyView) -> Terms:
        epsilon = self.options.epsilon
        epsilon_high = epsilon if self.options.epsilon_high is None else self.options.epsilon_high
        ratio, advantages = view.log_ratio.exp(), view.advantages
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
        detached = ratio.detach()
        low = view.keep & (detached < 1 - epsilon) & (advantages < 0)
        high = view.keep & (detached > 1 + epsilon_high) & (advantages > 0)
        return Terms(loss=-surrogate, metrics=clip_metrics(low, high, view.batch))
