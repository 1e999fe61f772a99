"""The clipped GRPO surrogate with masked importance sampling (the spec's ``score_centering=False`` loss)."""

from __future__ import annotations

import torch

from asyncrl.losses.base import (
    LOSSES,
    LossBatch,
    LossOutput,
    clip_metrics,
    importance_mask,
    sampling_metrics,
    to_floats,
)


@LOSSES.register("clipped")
def clipped_loss(
    batch: LossBatch,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    is_clip_min: float = 0.5,
    is_clip_max: float = 5.0,
) -> LossOutput:
    """DAPO-style asymmetric clip of r = pi_theta / mu_sampler; tokens with r outside the IS bounds are dropped.

    Per trained token: -1[is_clip_min <= r <= is_clip_max] * min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A),
    with epsilon_high = epsilon when None. clip_ratio/* count the tokens whose objective the clip actually
    flattens: r < 1 - epsilon with A < 0 (low) and r > 1 + epsilon_high with A > 0 (high), among kept tokens.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = batch.logprobs - batch.sampler_logprobs
    inside = importance_mask(log_ratio.detach(), is_clip_min, is_clip_max)
    active = (batch.mask > 0) & inside
    # Off the active set the log-ratio and advantage are replaced, so padding values can never reach the gradient.
    ratio = torch.where(active, log_ratio, 0).exp()
    advantages = torch.where(active, batch.advantages, 0)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
    loss_sum = -surrogate.sum()

    detached = ratio.detach()
    low = active & (detached < 1 - epsilon) & (advantages < 0)
    high = active & (detached > 1 + epsilon_high) & (advantages > 0)
    metrics = sampling_metrics(batch, log_ratio.detach(), inside) | clip_metrics(low, high, batch)
    return LossOutput(loss_sum=loss_sum, metrics=to_floats(metrics))
