"""Score centering (the spec's default loss): the masked-IS policy gradient minus its expectation under the
sampler at every position, estimated over the sampler's top-K tokens."""

from __future__ import annotations

import math

import torch

from asyncrl.losses.base import (
    LOSSES,
    LossBatch,
    LossOutput,
    clip_metrics,
    importance_mask,
    masked_mean,
    requires,
    sampling_metrics,
    to_floats,
)


@LOSSES.register("score_centering")
@requires("top_logprobs", "sampler_top_logprobs")
def score_centering_loss(
    batch: LossBatch,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    is_clip_min: float = 0.5,
    is_clip_max: float = 5.0,
) -> LossOutput:
    """Score centering: grad = -A (f(r_t) grad log pi(o_t) - sum_{v in top-K} mu(v) f(r_v) grad log pi(v)).

    f(r) = r on [is_clip_min, is_clip_max] and 0 outside. Holding the bound indicators fixed,
    f(r) grad log pi = grad r and mu(v) r_v = pi(v), so the surrogate
    -A (1[r_t in] r_t - sum_v 1[r_v in] pi(v)) has exactly that gradient. A token whose own ratio leaves the
    bounds keeps its centering term, as in the spec's formula.

    The inner expectation weights each top-K token by its raw sampler probability mu(v), not by mu
    renormalised over the top K. Every kept term then has its true weight: E_{o~mu}[f(r_o) grad log pi(o)]
    is exactly sum_v mu(v) f(r_v) grad log pi(v) over the whole vocabulary, so the centred gradient has zero
    mean for a fixed advantage and the only error is the omitted tail. Renormalising would scale every kept
    term by 1/mass, which adds error: at pi = mu the kept sum is minus the tail sum, and the residual grows
    from the tail's to the tail's divided by the mass.

    epsilon/epsilon_high only feed clip_ratio/*, which count trained tokens outside [1 - epsilon,
    1 + epsilon_high] since nothing is clipped here.
    """
    if batch.top_logprobs is None or batch.sampler_top_logprobs is None:
        raise ValueError(
            "loss 'score_centering' needs LossBatch.top_logprobs and sampler_top_logprobs "
            "(set sampling.num_sampler_logprobs > 0, or use loss=clipped)"
        )
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    trained = batch.mask > 0
    log_ratio = batch.logprobs - batch.sampler_logprobs
    inside = importance_mask(log_ratio.detach(), is_clip_min, is_clip_max)
    # where() before exp(): excluded and padding slots become exp(-inf) = 0 with an exactly zero gradient.
    sampled_term = torch.where(trained & inside, log_ratio, -math.inf).exp()

    sampler_top = batch.sampler_top_logprobs
    top_inside = importance_mask((batch.top_logprobs - sampler_top).detach(), is_clip_min, is_clip_max)
    kept = top_inside & sampler_top.isfinite() & trained.unsqueeze(-1)
    centering_term = torch.where(kept, batch.top_logprobs, -math.inf).exp().sum(-1)

    advantages = torch.where(trained, batch.advantages, 0)
    loss_sum = -(advantages * (sampled_term - centering_term)).sum()

    ratio = log_ratio.detach().exp()
    low = trained & (ratio < 1 - epsilon)
    high = trained & (ratio > 1 + epsilon_high)
    sampler_mass = sampler_top.detach().exp().sum(-1)
    metrics = sampling_metrics(batch, log_ratio.detach(), inside) | clip_metrics(low, high, batch)
    metrics["sampling/sampler_mass"] = masked_mean(sampler_mass, trained)
    return LossOutput(loss_sum=loss_sum, metrics=to_floats(metrics))
