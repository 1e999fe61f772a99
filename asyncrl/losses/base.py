"""The loss contract: what the trainer hands a loss (LossBatch), what it gets back (LossOutput), and the
helpers every loss shares (the importance-sampling mask and the spec's sampling/clip metrics).

The trainer calls the configured loss (``Components.loss``, a ``PolicyLoss``) once per micro-batch through
``StepLoss``, which divides ``loss_sum`` by the step's normaliser and adds the entropy bonus; a loss knows
nothing of config or ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class LossBatch:
    """Per-token inputs of one micro-batch, 1-D over its T trained-token slots (top-K fields are [T, K])."""

    logprobs: Tensor
    """Trainer log pi_theta(o_t) at the sampling temperature; requires grad."""
    sampler_logprobs: Tensor
    """Sampler (vLLM processed) log mu(o_t); no grad."""
    advantages: Tensor
    """Advantage of the sample each token belongs to."""
    mask: Tensor
    """Float 0/1: 1 = trained token, 0 = padding or context."""
    sequence_index: Tensor
    """Long: which sample of the micro-batch each token belongs to (for per-completion metrics)."""
    top_logprobs: Tensor | None = None
    """[T, K] trainer log pi_theta(v) for the sampler's top-K ids; requires grad."""
    sampler_top_logprobs: Tensor | None = None
    """[T, K] sampler log mu(v) for those ids; -inf where the sampler returned fewer than K."""
    entropy: Tensor | None = None
    """[T] entropy of pi_theta at each slot; its gradient is used when it requires grad (top_entropy_quantile,
    entropy bonus)."""
    truncated: Tensor | None = None
    """[T] bool: the slot's completion ended on the length budget (mask_truncated_completions)."""
    ref_logprobs: Tensor | None = None
    """[T] reference log pi_ref(o_t) at the sampling temperature, for the KL penalty (beta > 0); no grad."""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if len(shape) != 1:
            raise ValueError(f"LossBatch.logprobs must be 1-D [T], got shape {tuple(shape)}")
        given = [name for name in ("entropy", "truncated", "ref_logprobs") if getattr(self, name) is not None]
        for name in ("sampler_logprobs", "advantages", "mask", "sequence_index", *given):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"LossBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}"
                )
        if (self.top_logprobs is None) != (self.sampler_top_logprobs is None):
            raise ValueError("LossBatch.top_logprobs and LossBatch.sampler_top_logprobs must be given together")
        if self.top_logprobs is not None and self.sampler_top_logprobs is not None:
            top_shape = self.top_logprobs.shape
            if len(top_shape) != 2 or top_shape[0] != shape[0] or self.sampler_top_logprobs.shape != top_shape:
                raise ValueError(
                    f"LossBatch.top_logprobs {tuple(top_shape)} and sampler_top_logprobs "
                    f"{tuple(self.sampler_top_logprobs.shape)} must both be [T={shape[0]}, K]"
                )


@dataclass
class LossOutput:
    """A loss's result: the SUM over trained tokens, and float metrics named as in the spec."""

    loss_sum: Tensor
    """Sum of the per-token objective (each token weighted 1/|o_i| under normalization=sequence)."""
    metrics: dict[str, float]
    entropy_mean: Tensor | None = None
    """Mean entropy over the loss's token set, whose gradient is the entropy's; only when a bonus is configured."""


OPTIONAL_FIELDS = frozenset(f.name for f in fields(LossBatch) if f.default is None)


def importance_mask(log_ratio: Tensor, is_clip_min: float, is_clip_max: float) -> Tensor:
    """True where is_clip_min <= ratio <= is_clip_max, compared in log space so huge ratios cannot overflow."""
    if not 0.0 <= is_clip_min <= is_clip_max:
        raise ValueError(f"loss needs 0 <= is_clip_min <= is_clip_max, got {is_clip_min} and {is_clip_max}")
    low = math.log(is_clip_min) if is_clip_min > 0 else -math.inf
    return (log_ratio >= low) & (log_ratio <= math.log(is_clip_max))


def masked_mean(values: Tensor, where: Tensor) -> Tensor:
    """Mean of ``values`` where ``where`` is True; NaN when nothing is selected."""
    return torch.where(where, values, 0).sum() / where.sum()


def masked_extreme(values: Tensor, where: Tensor, largest: bool) -> Tensor:
    """Max (or min) of ``values`` where ``where`` is True; NaN (no metric) when nothing is selected, a micro-batch
    without trained tokens included (an empty tensor has no max)."""
    if values.numel() == 0:
        return values.new_tensor(math.nan)
    fill = -math.inf if largest else math.inf
    selected = torch.where(where, values, fill)
    extreme = selected.max() if largest else selected.min()
    return torch.where(where.any(), extreme, math.nan)


def sampling_metrics(batch: LossBatch, log_ratio: Tensor, inside: Tensor) -> dict[str, Tensor]:
    """The spec's sampling/* metrics over trained tokens; the ratio is taken before IS exclusion."""
    trained = batch.mask > 0
    ratio = log_ratio.exp()
    difference = log_ratio.abs()
    return {
        "sampling/importance_sampling_ratio/mean": masked_mean(ratio, trained),
        "sampling/importance_sampling_ratio/min": masked_extreme(ratio, trained, largest=False),
        "sampling/importance_sampling_ratio/max": masked_extreme(ratio, trained, largest=True),
        "sampling/masked_mean": masked_mean((~inside).to(ratio.dtype), trained),
        "sampling/sampling_logp_difference/mean": masked_mean(difference, trained),
        "sampling/sampling_logp_difference/max": masked_extreme(difference, trained, largest=True),
    }


def per_sequence_fraction(flags: Tensor, trained: Tensor, sequence_index: Tensor) -> Tensor:
    """Fraction of each sequence's trained tokens that are flagged; NaN for a sequence with none trained."""
    _, slot = torch.unique(sequence_index, return_inverse=True)
    size = sequence_index.numel()
    counts = torch.zeros(size, dtype=torch.float64, device=flags.device).index_add_(0, slot, trained.double())
    hits = torch.zeros_like(counts).index_add_(0, slot, (flags & trained).double())
    return hits / counts


def clip_metrics(low: Tensor, high: Tensor, batch: LossBatch) -> dict[str, Tensor]:
    """The spec's clip_ratio/* metrics from per-token flags: means over trained tokens, extremes per completion."""
    trained = batch.mask > 0
    low_frac = per_sequence_fraction(low, trained, batch.sequence_index)
    high_frac = per_sequence_fraction(high, trained, batch.sequence_index)
    dtype = batch.logprobs.dtype
    return {
        "clip_ratio/region_mean": masked_mean((low | high).to(dtype), trained),
        "clip_ratio/low_mean": masked_mean(low.to(dtype), trained),
        "clip_ratio/high_mean": masked_mean(high.to(dtype), trained),
        "clip_ratio/low_min": masked_extreme(low_frac, ~low_frac.isnan(), largest=False),
        "clip_ratio/high_max": masked_extreme(high_frac, ~high_frac.isnan(), largest=True),
    }


def to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Detach and move every metric to Python floats with a single device sync."""
    values = torch.stack([value.detach().double() for value in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))
