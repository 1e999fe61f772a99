"""Score centering (the spec's default loss): the masked-IS policy gradient minus its expectation under the
sampler at every position, estimated over the sampler's top-K tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncrl.losses.base import clip_metrics, masked_mean
from asyncrl.losses.clipped import ClippedOptions
from asyncrl.losses.policy import LOSSES, PolicyLoss, PolicyView, Terms, correct_token_ratio


@dataclass(frozen=True)
class ScoreCenteringOptions(ClippedOptions):
    """epsilon/epsilon_high only feed clip_ratio/* (nothing is clipped)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.importance_sampling.startswith("sequence"):
            raise ValueError(
                f"loss 'score_centering' centres each position: importance_sampling="
                f"{self.importance_sampling} must be token_mask, token_truncate or none"
            )
        if self.importance_sampling_level == "sequence":
            raise ValueError("loss 'score_centering' centres each position on its own ratio: "
                             "importance_sampling_level=sequence must be token (or use loss=clipped)")  # fmt: skip
        if self.delta is not None:
            raise ValueError(f"loss 'score_centering' clips nothing: delta={self.delta} is loss=clipped's "
                             "(set delta=null)")  # fmt: skip


@LOSSES.register("score_centering")
class ScoreCentering(PolicyLoss):
    """Score centering: grad = -A (f(r_t) grad log pi(o_t) - sum_{v in top-K} mu(v) f(r_v) grad log pi(v)).

    f(r) = r on [is_clip_min, is_clip_max] and 0 outside (token_mask); f(r) = clip(r) under token_truncate;
    f(r) = r under none. Holding f's bounds fixed, f(r) grad log pi = grad f(r) and mu(v) r_v = pi(v), so the
    surrogate -A (f(r_t) - sum_v mu(v) f(r_v)) has exactly that gradient. A token whose own ratio leaves the
    bounds keeps its centering term, as in the spec's formula. Sequence-level corrections would weight a
    whole sequence, which a per-position centring does not define, so they are rejected.

    The inner expectation weights each top-K token by its raw sampler probability mu(v), not by mu
    renormalised over the top K. Every kept term then has its true weight: E_{o~mu}[f(r_o) grad log pi(o)]
    is exactly sum_v mu(v) f(r_v) grad log pi(v) over the whole vocabulary, so the centred gradient has zero
    mean for a fixed advantage and the only error is the omitted tail. Renormalising would scale every kept
    term by 1/mass, which adds error: at pi = mu the kept sum is minus the tail sum, and the residual grows
    from the tail's to the tail's divided by the mass.

    epsilon/epsilon_high only feed clip_ratio/*, which count trained tokens outside [1 - epsilon,
    1 + epsilon_high] since nothing is clipped here.
    """

    Options = ScoreCenteringOptions
    options: ScoreCenteringOptions
    requires = frozenset({"top_logprobs", "sampler_top_logprobs"})
    masks_own_ratio = True

    def terms(self, view: PolicyView) -> Terms:
        options = self.options
        batch = view.batch
        if batch.top_logprobs is None or batch.sampler_top_logprobs is None:
            raise ValueError(
                "loss 'score_centering' needs LossBatch.top_logprobs and sampler_top_logprobs "
                "(set sampling.num_sampler_logprobs > 0, or use loss=clipped)"
            )
        epsilon, epsilon_high = options.epsilon, options.clip_high
        # where() before exp(): excluded and padding slots become exp(-inf) = 0 with an exactly zero gradient.
        sampled_term = torch.where(view.keep & view.inside, view.log_ratio, -math.inf).exp()

        sampler_top = batch.sampler_top_logprobs
        listed = sampler_top.isfinite() & view.keep.unsqueeze(-1)
        top_log_ratio, top_inside = correct_token_ratio(torch.where(listed, batch.top_logprobs - sampler_top, 0),
                                                        options)  # fmt: skip
        # mu(v) f(r_v) with the bounds held fixed is exp(log mu(v) + corrected log r_v).
        centering_term = torch.where(listed & top_inside, sampler_top + top_log_ratio, -math.inf).exp().sum(-1)

        ratio = view.raw_log_ratio.exp()
        low = view.keep & (ratio < 1 - epsilon)
        high = view.keep & (ratio > 1 + epsilon_high)
        metrics = clip_metrics(low, high, batch)
        metrics["sampling/sampler_mass"] = masked_mean(sampler_top.detach().exp().sum(-1), batch.mask > 0)
        return Terms(loss=-view.advantages * (sampled_term - centering_term), metrics=metrics)
