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
    delta: float | None = None
    """TRL's two-sided clip (INTELLECT-2): the unclipped ratio is capped at delta too; None = off."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delta is not None and not self.delta > 1 + self.clip_high:
            raise ValueError(f"delta={self.delta} must be > 1 + epsilon_high = {1 + self.clip_high:g}: it caps the "
                             "ratio above the clip range (INTELLECT-2 uses 4; null = off)")  # fmt: skip

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon: epsilon_high, or epsilon where it is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@LOSSES.register("clipped")
class Clipped(PolicyLoss):
    """DAPO-style asymmetric clip of r = pi_theta / mu_sampler; tokens with r outside the IS bounds are dropped.

    Per trained token: -1[is_clip_min <= r <= is_clip_max] * min(min(r, delta) A, clip(r, 1 - epsilon,
    1 + epsilon_high) A), with epsilon_high = epsilon when None and no min(., delta) when delta is None: the cap
    bounds the loss of a negative advantage whose ratio exploded (TRL's delta). clip_ratio/* count the tokens
    whose objective the clip actually flattens: r < 1 - epsilon with A < 0 (low) and r > 1 + epsilon_high with
    A > 0 (high), among kept tokens.
    """

    Options = ClippedOptions
    options: ClippedOptions

    def terms(self, view: PolicyView) -> Terms:
        epsilon, epsilon_high, delta = self.options.epsilon, self.options.clip_high, self.options.delta
        ratio, advantages = view.log_ratio.exp(), view.advantages
        capped = ratio if delta is None else ratio.clamp(max=delta)
        surrogate = torch.minimum(capped * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
        detached = ratio.detach()
        low = view.keep & (detached < 1 - epsilon) & (advantages < 0)
        high = view.keep & (detached > 1 + epsilon_high) & (advantages > 0)
        return Terms(loss=-surrogate, metrics=clip_metrics(low, high, view.batch))
