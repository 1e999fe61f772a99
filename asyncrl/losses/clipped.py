"""The clipped GRPO surrogate with masked importance sampling (the spec's ``score_centering=False`` loss)."""

from __future__ import annotations

import torch

from asyncrl.losses.base import LOSSES, clip_metrics
from asyncrl.losses.policy import PolicyView, Terms, policy_loss


@LOSSES.register("clipped")
@policy_loss()
def clipped_loss(view: PolicyView, *, epsilon: float = 0.2, epsilon_high: float | None = None) -> Terms:
    """DAPO-style asymmetric clip of r = pi_theta / mu_sampler; tokens with r outside the IS bounds are dropped.

    Per trained token: -1[is_clip_min <= r <= is_clip_max] * min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A),
    with epsilon_high = epsilon when None. clip_ratio/* count the tokens whose objective the clip actually
    flattens: r < 1 - epsilon with A < 0 (low) and r > 1 + epsilon_high with A > 0 (high), among kept tokens.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio, advantages = view.log_ratio.exp(), view.advantages
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
    detached = ratio.detach()
    low = view.keep & (detached < 1 - epsilon) & (advantages < 0)
    high = view.keep & (detached > 1 + epsilon_high) & (advantages > 0)
    return Terms(loss=-surrogate, metrics=clip_metrics(low, high, view.batch))
