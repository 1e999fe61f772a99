"""The options every policy loss shares, applied in one place for all of them.

A loss is a ``PolicyLoss`` subclass (registered in ``LOSSES``) whose ``Options`` extend ``PolicyOptions`` with
its own fields (and may change a shared default, e.g. GSPO's sequence normalisation). It writes only its
per-slot objective, ``terms(view)``, as a function of a ``PolicyView``; ``PolicyLoss.__call__`` applies the
shared options and turns the objective into a ``LossOutput``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import torch
from torch import Tensor

from asyncrl.losses.base import (
    OPTIONAL_FIELDS,
    LossBatch,
    LossOutput,
    importance_mask,
    masked_mean,
    sampling_metrics,
    to_floats,
)
from asyncrl.registry import Component, ComponentRegistry


class ImportanceSampling(StrEnum):
    """Correction against the sampler: {token,sequence}_{mask,truncate} within [is_clip_min, is_clip_max], or none."""

    token_mask = "token_mask"
    token_truncate = "token_truncate"
    sequence_mask = "sequence_mask"
    sequence_truncate = "sequence_truncate"
    none = "none"


class Normalization(StrEnum):
    """token (DAPO), sequence (GRPO), constant (Dr. GRPO) or micro_batch (BNPO); StepLoss divides accordingly."""

    token = "token"
    sequence = "sequence"
    constant = "constant"
    micro_batch = "micro_batch"


class ImportanceSamplingLevel(StrEnum):
    """The ratio a loss's objective sees: each token's r_t, or on every token its sequence's exp(mean_t log r_t)
    over the kept slots (GSPO; TRL's importance_sampling_level)."""

    token = "token"
    sequence = "sequence"


IS_MODES = tuple(ImportanceSampling)


@dataclass(frozen=True)
class PolicyOptions:
    """Shared loss options; docs/losses.md describes each one."""

    importance_sampling: ImportanceSampling = ImportanceSampling.token_mask
    is_clip_min: float = 0.5
    is_clip_max: float = 5.0
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's delta: drop a sequence with A < 0 whose mean log(mu / pi_theta) exceeds it; None = off."""
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    """Keep only slots whose entropy is in this top fraction of the micro-batch (1.0 keeps all)."""
    normalization: Normalization = Normalization.token
    entropy_coef: float = 0.0
    entropy_target: float | None = None
    """None: entropy_coef is a fixed bonus coefficient; a value: the coefficient adapts toward it (StepLoss)."""
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    importance_sampling_level: ImportanceSamplingLevel = ImportanceSamplingLevel.token
    beta: float = 0.0
    """Weight of the KL penalty to a frozen reference model (TRL's beta); 0 = none, and no reference is loaded."""
    use_bias_correction_kl: bool = True
    """Multiply each token's KL by the loss's ratio pi_theta / pi_sampler (DeepSeek-V3.2's unbiased estimate)."""
    sync_ref_model: bool = False
    """TR-DPO: every ref_model_sync_steps steps, ref = ref_model_mixup_alpha * policy + (1 - alpha) * ref."""
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    def __post_init__(self) -> None:
        kinds = (("importance_sampling", ImportanceSampling), ("normalization", Normalization),
                 ("importance_sampling_level", ImportanceSamplingLevel))  # fmt: skip
        for name, kind in kinds:
            if getattr(self, name) not in set(kind):  # set directly rather than by the registry
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(kind)}")
        if not 0 <= self.is_clip_min <= self.is_clip_max:
            raise ValueError(f"is_clip_min={self.is_clip_min}, is_clip_max={self.is_clip_max}: need 0 <= min <= max")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise ValueError(f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0 (or null)")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1]")
        if self.entropy_coef < 0 or self.entropy_coef_delta < 0:
            raise ValueError(f"entropy_coef={self.entropy_coef} and entropy_coef_delta must be >= 0")
        adaptive = self.entropy_target is not None
        if adaptive and not 0 <= self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef={self.entropy_coef} must lie in [entropy_coef_min={self.entropy_coef_min}, "
                f"entropy_coef_max={self.entropy_coef_max}] (with 0 <= min) when entropy_target is set"
            )
        self._check_reference()

    def _check_reference(self) -> None:
        """The KL penalty's options: a reference exists only with beta > 0, so only then can it be synced."""
        if not self.beta >= 0:
            raise ValueError(f"beta={self.beta} must be >= 0 (0 = no KL penalty and no reference model)")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model=true needs beta > 0: without the KL penalty there is no reference "
                             "model to sync (try beta=0.001, or sync_ref_model=false)")  # fmt: skip
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ValueError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1] (TR-DPO uses 0.6)")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1 (TR-DPO uses 512)")

    @property
    def entropy_bonus(self) -> bool:
        return self.entropy_coef != 0 or self.entropy_target is not None


@dataclass(frozen=True)
class SequenceOptions(PolicyOptions):
    """The defaults of losses whose papers correct the ratio themselves and average per sequence (GSPO, SAPO)."""

    importance_sampling: ImportanceSampling = ImportanceSampling.none
    normalization: Normalization = Normalization.sequence


@dataclass
class PolicyView:
    """One micro-batch as a loss sees it, every mask and correction applied; [T] per slot, [S] per sequence.

    ``log_ratio``, ``logprobs`` and ``advantages`` are zero off ``keep``, so no padding value reaches a gradient.
    """

    batch: LossBatch
    options: PolicyOptions
    keep: Tensor
    """Slots whose objective counts."""
    inside: Tensor
    """Slots inside the token importance bounds (all True unless importance_sampling=token_mask)."""
    log_ratio: Tensor
    """log pi_theta / mu as the loss must use it: clamped in value under token_truncate, 0 in value (gradient
    of log pi_theta) under the sequence modes, whose weight carries the correction; at
    importance_sampling_level=sequence, its sequence's mean over the kept slots on each slot."""
    logprobs: Tensor
    advantages: Tensor
    weight: Tensor
    """Detached per-slot factor: the sequence importance weight and the per-sequence normalisation."""
    raw_log_ratio: Tensor
    corrected: Tensor
    """Trained slots the importance correction dropped or clamped (sampling/masked_mean)."""
    entropy_set: Tensor
    """Slots the entropy bonus averages over: trained, not dropped as truncated, in the top-entropy set."""
    policy: Tensor
    """Trained slots of completions not dropped as truncated: those the KL penalty covers."""
    slot: Tensor
    lengths: Tensor
    """Trained slots of each sequence."""

    def sequence_sum(self, values: Tensor) -> Tensor:
        """[S] sum of ``values`` over each sequence's kept slots."""
        return sequence_sum(values, self.keep, self.slot, len(self.lengths))

    def sequence_mean(self, values: Tensor) -> Tensor:
        """[S] mean of ``values`` over each sequence's kept slots (0 for a sequence with none kept)."""
        count = self.sequence_sum(torch.ones_like(values))
        return self.sequence_sum(values) / count.clamp(min=1)


@dataclass
class Terms:
    """What a loss module computes: the per-slot objective to minimise and its own metrics."""

    loss: Tensor
    metrics: dict[str, Tensor]


class PolicyLoss(Component, ABC):
    """A registered loss: ``loss(batch) -> LossOutput`` under its ``options``.

    Class attributes declare what it needs: ``requires``, the optional LossBatch fields it reads (config
    validation rejects a config lacking them, the trainer computes them); ``masks_own_ratio``, token_mask does
    not drop slots and the loss applies ``view.inside`` to each ratio itself.
    """

    Options: ClassVar[type] = PolicyOptions
    options: PolicyOptions
    requires: ClassVar[frozenset[str]] = frozenset()
    masks_own_ratio: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        unknown = sorted(cls.requires - OPTIONAL_FIELDS)
        if unknown:
            raise TypeError(f"{cls.__name__}.requires: {unknown} are not optional LossBatch fields "
                            f"({sorted(OPTIONAL_FIELDS)})")  # fmt: skip

    def __call__(self, batch: LossBatch) -> LossOutput:
        view = build_view(batch, self.options, self.masks_own_ratio)
        return finish(view, self.terms(view))

    @abstractmethod
    def terms(self, view: PolicyView) -> Terms:
        """The per-slot objective to minimise and the loss's own metrics."""


LOSSES: ComponentRegistry[PolicyLoss] = ComponentRegistry("loss", PolicyLoss)


def sequence_sum(values: Tensor, where: Tensor, slot: Tensor, sequences: int) -> Tensor:
    """[S] sum of ``values`` over each sequence's slots in ``where``."""
    kept = torch.where(where, values, 0)
    return torch.zeros(sequences, dtype=values.dtype, device=values.device).index_add(0, slot, kept)


def sequence_level(log_ratio: Tensor, keep: Tensor, slot: Tensor, sequences: int) -> Tensor:
    """[T] each slot's sequence's mean log-ratio over its kept slots (GSPO's length-normalised sequence ratio), with
    the gradient of that mean: importance_sampling_level=sequence."""
    count = sequence_sum(torch.ones_like(log_ratio), keep, slot, sequences).clamp(min=1)
    return (sequence_sum(log_ratio, keep, slot, sequences) / count)[slot]


def log_bounds(options: PolicyOptions) -> tuple[float, float]:
    low = math.log(options.is_clip_min) if options.is_clip_min > 0 else -math.inf
    return low, math.log(options.is_clip_max)


def correct_token_ratio(log_ratio: Tensor, options: PolicyOptions) -> tuple[Tensor, Tensor]:
    """(log-ratio to use, inside-bounds mask) under the token modes; unchanged and all-inside otherwise.

    token_truncate keeps the gradient of log pi_theta and clamps the value, so the ratio's value and its
    gradient's scale are both clip(r, is_clip_min, is_clip_max).
    """
    everywhere = torch.ones_like(log_ratio, dtype=torch.bool)
    detached = log_ratio.detach()
    if options.importance_sampling == "token_mask":
        return log_ratio, importance_mask(detached, options.is_clip_min, options.is_clip_max)
    if options.importance_sampling == "token_truncate":
        low, high = log_bounds(options)
        return log_ratio + (detached.clamp(low, high) - detached), everywhere
    return log_ratio, everywhere


def build_view(batch: LossBatch, options: PolicyOptions, masks_own_ratio: bool) -> PolicyView:
    trained = batch.mask > 0
    sequences, slot = torch.unique(batch.sequence_index, return_inverse=True)
    dtype = batch.logprobs.dtype
    lengths = torch.zeros(len(sequences), dtype=dtype, device=slot.device).index_add(0, slot, trained.to(dtype))
    raw = torch.where(trained, batch.logprobs - batch.sampler_logprobs, 0)
    policy = trained & ~required(batch.truncated, "truncated", "mask_truncated_completions") \
        if options.mask_truncated_completions else trained  # fmt: skip
    top = top_entropy(batch, policy, options.top_entropy_quantile)
    threshold = options.off_policy_mask_threshold
    keep = policy & top & off_policy_keep(batch, raw.detach(), trained, slot, lengths, threshold)
    log_ratio, inside = correct_token_ratio(raw, options)
    weight = torch.ones_like(raw)
    corrected = trained & ~inside if options.importance_sampling == "token_mask" else torch.zeros_like(trained)
    if options.importance_sampling == "token_truncate":
        low, high = log_bounds(options)
        corrected = trained & ((raw.detach() < low) | (raw.detach() > high))
    if options.importance_sampling.startswith("sequence"):
        log_weight, sequence_inside = sequence_weight(raw.detach(), slot, lengths, options)
        weight, log_ratio = log_weight.exp()[slot], raw - raw.detach()
        corrected = trained & ~sequence_inside[slot]
        if options.importance_sampling == "sequence_mask":
            keep = keep & sequence_inside[slot]
    if not masks_own_ratio:
        keep = keep & inside
    if options.importance_sampling_level == "sequence":
        log_ratio = sequence_level(log_ratio, keep, slot, len(sequences))
    if options.normalization == "sequence":
        weight = weight / lengths.clamp(min=1)[slot]
    zero = torch.zeros((), dtype=dtype, device=raw.device)
    return PolicyView(
        batch=batch, options=options, keep=keep, inside=inside, log_ratio=torch.where(keep, log_ratio, zero),
        logprobs=torch.where(keep, batch.logprobs, zero), advantages=torch.where(keep, batch.advantages, zero),
        weight=torch.where(keep, weight, zero), raw_log_ratio=raw.detach(), corrected=corrected,
        entropy_set=policy & top, policy=policy, slot=slot, lengths=lengths,
    )  # fmt: skip


def sequence_weight(raw: Tensor, slot: Tensor, lengths: Tensor, options: PolicyOptions) -> tuple[Tensor, Tensor]:
    """[S] log importance weight of each sequence (log prod_t r_t, clamped under sequence_truncate, 0 where
    sequence_mask drops it) and whether its ratio lies inside the bounds."""
    total = torch.zeros_like(lengths).index_add(0, slot, raw)
    inside = importance_mask(total, options.is_clip_min, options.is_clip_max)
    if options.importance_sampling == "sequence_truncate":
        return total.clamp(*log_bounds(options)), inside
    return torch.where(inside, total, 0), inside


def off_policy_keep(
    batch: LossBatch, raw: Tensor, trained: Tensor, slot: Tensor, lengths: Tensor, threshold: float | None
) -> Tensor:
    """DeepSeek-V3.2 eq. 9: False on sequences with A < 0 and mean_t log(mu / pi_theta) > threshold."""
    if threshold is None:
        return torch.ones_like(trained)
    count = lengths.clamp(min=1)
    gap = torch.zeros_like(lengths).index_add(0, slot, -raw) / count
    advantage = torch.zeros_like(lengths).index_add(0, slot, torch.where(trained, batch.advantages, 0)) / count
    return ~((advantage < 0) & (gap > threshold))[slot]


def top_entropy(batch: LossBatch, candidates: Tensor, quantile: float) -> Tensor:
    """Slots whose entropy is at least the (1 - quantile) quantile over ``candidates`` ("Beyond the 80/20 rule")."""
    if quantile >= 1:
        return torch.ones_like(candidates)
    entropy = required(batch.entropy, "entropy", "top_entropy_quantile").detach()
    if not candidates.any():
        return candidates
    threshold = torch.quantile(entropy[candidates].double(), 1 - quantile)
    return entropy.double() >= threshold


def required(value: Tensor | None, field: str, option: str) -> Tensor:
    if value is None:
        raise ValueError(f"loss option {option} needs LossBatch.{field} (the trainer always sets it)")
    return value


def entropy_term(view: PolicyView) -> Tensor | None:
    """Mean entropy over ``view.entropy_set`` as a surrogate whose gradient estimates the entropy's.

    With a differentiable ``batch.entropy`` that gradient is exact. Otherwise it is the score-function
    estimate from the sampled token: grad H = -E_pi[(log pi + H) grad log pi], taken under the sampler with
    the loss's importance ratio, on slots the loss keeps. The value is always the exact entropy.
    """
    if not view.options.entropy_bonus:
        return None
    entropy = required(view.batch.entropy, "entropy", "entropy_coef / entropy_target")
    selected = view.entropy_set
    zero = torch.zeros((), dtype=view.batch.logprobs.dtype, device=selected.device)
    per_slot = torch.where(selected, entropy, zero)
    if not entropy.requires_grad:
        active = view.keep & view.inside & selected
        ratio = torch.where(active, view.log_ratio.detach(), -math.inf).exp()
        logprobs = torch.where(active, view.batch.logprobs, zero)
        score_weight = -ratio * (logprobs.detach() + per_slot.detach())
        per_slot = per_slot + score_weight * (logprobs - logprobs.detach())
    return torch.where(selected, per_slot, zero).sum() / selected.sum().clamp(min=1)


def kl_penalty(view: PolicyView) -> tuple[Tensor | float, dict[str, Tensor]]:
    """beta x the KL to the reference summed over ``view.policy``, and its ``kl`` metric (their mean KL); nothing
    at beta = 0.

    Per slot the k3 estimate exp(d) - d - 1, d = log pi_ref - log pi_theta (Schulman), which TRL adds after
    every other mask: the top-entropy, off-policy and importance-sampling masks do not drop it, nor does the
    sampler correction's weight scale it; sequence normalisation weighs it 1/|o_i| as the policy term. Under
    use_bias_correction_kl it is multiplied by the loss's own ratio exp(view.log_ratio) (the sequence ratio at
    importance_sampling_level=sequence; 1 on slots the loss drops), gradient included.
    """
    options = view.options
    if options.beta == 0:
        return 0.0, {}
    reference = required(view.batch.ref_logprobs, "ref_logprobs", "beta")
    gap = torch.where(view.policy, reference - view.batch.logprobs, 0)
    kl = gap.exp() - gap - 1
    if options.use_bias_correction_kl:
        kl = kl * view.log_ratio.exp()
    weight = 1 / view.lengths.clamp(min=1)[view.slot] if options.normalization == "sequence" else 1
    total = torch.where(view.policy, weight * kl, 0).sum()
    return options.beta * total, {"kl": masked_mean(kl, view.policy)}


def finish(view: PolicyView, terms: Terms) -> LossOutput:
    """Weight and sum the kept per-slot objective, add the KL penalty; add the spec's sampling metrics."""
    penalty, kl_metrics = kl_penalty(view)
    loss_sum = torch.where(view.keep, view.weight * terms.loss, 0).sum() + penalty
    metrics = sampling_metrics(view.batch, view.raw_log_ratio, ~view.corrected) | terms.metrics | kl_metrics
    return LossOutput(loss_sum=loss_sum, metrics=to_floats(metrics), entropy_mean=entropy_term(view))
