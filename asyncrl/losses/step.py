"""The trainer's side of the loss: each micro-batch's ``loss_sum`` becomes its share of the step's loss.

Per optimizer step rank 0 computes the step's ``StepNorm`` once from all its rows (``StepLoss.norm``: the
normaliser's counts, the step-level advantage shift and scale, the entropy coefficient) and sends it with each
rank's rows. Every rank then turns each of its rows into ``batch(row, forward, norm)`` and backpropagates
``loss(batch, norm)``, which reads nothing else that changes during a step, and returns its ``StepTotals``;
rank 0 adds the ranks' totals and ends the step with them (``end_step``), which moves the adaptive entropy
coefficient (checkpointed through ``state_dict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from asyncrl.advantages import Estimator, step_affine
from asyncrl.losses.base import LossBatch
from asyncrl.losses.policy import PolicyLoss

if TYPE_CHECKING:
    from asyncrl.packing.row import PackedRow
    from asyncrl.rollout.types import RolloutSample


@dataclass(frozen=True)
class StepCounts:
    tokens: int = 0
    """Trained tokens of the step, less those of completions dropped by mask_truncated_completions."""
    sequences: int = 0
    micro_batches: int = 0


@dataclass(frozen=True)
class StepNorm:
    """What one step's loss is normalised by, decided once from every row of the step (on rank 0) and carried
    with the rows: a rank's own share of them cannot tell the step's counts or its rollouts' spread."""

    counts: StepCounts = StepCounts()
    shift: float = 0.0
    """The step-level advantage affine (advantage estimators that normalise over a batch): (A - shift) / scale."""
    scale: float = 1.0
    entropy_coef: float = 0.0
    """The entropy bonus's coefficient for this step (adaptive under entropy_target: rank 0 owns its state)."""


@dataclass(frozen=True)
class StepTotals:
    """What micro-batches add up to over a step: the loss (on the device while a rank trains, so that adding a
    micro-batch does not wait for it), and under an entropy bonus the policy part and the token-weighted
    entropy. Each rank returns its own; rank 0 adds them."""

    loss: Tensor | float = 0.0
    policy_loss: float = 0.0
    entropy: float = 0.0

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.loss + other.loss, self.policy_loss + other.policy_loss, self.entropy + other.entropy)

    def on_host(self) -> StepTotals:
        return StepTotals(float(self.loss), self.policy_loss, self.entropy)


class StepLoss:
    """Normalise, add the entropy bonus, finish step-level advantages; one instance per rank and run.

    normalization divides each micro-batch's loss_sum by: token -> the step's tokens (DAPO, the spec's
    default); sequence -> the step's sequences, the loss having weighted each slot by 1/|o_i| (GRPO);
    constant -> max_completion_length x sequences (Dr. GRPO); micro_batch -> the micro-batch's own tokens
    x the number of micro-batches (BNPO).

    The entropy bonus subtracts coef x the step's mean entropy, whatever the normalisation: each micro-batch
    adds coef x (its tokens / step tokens) x its mean. With entropy_target set the coefficient is adaptive
    (Skywork-OR1): after each step it moves by entropy_coef_delta up if the step's entropy is at or below
    the target, down otherwise, within [entropy_coef_min, entropy_coef_max]; it is applied only to
    micro-batches whose entropy is at or below the target.
    """

    def __init__(
        self, loss_fn: PolicyLoss, advantage: Estimator | None = None, max_completion_length: int = 1
    ) -> None:  # fmt: skip
        self.loss_fn = loss_fn
        self.options = loss_fn.options
        self.requires = loss_fn.requires
        self.advantage_rule = None if advantage is None else advantage.step_rule
        self.max_completion_length = max_completion_length
        self.entropy_coef = self.options.entropy_coef
        # Counting a micro-batch's tokens syncs the device, so only where the result depends on it.
        self.needs_tokens = self.options.normalization == "micro_batch" or self.options.entropy_bonus
        self.router_aux_coef = 0.0
        """The MoE load-balancing weight (trainer/moe.py), set once the model is known."""

    # ---- per step ------------------------------------------------------------------------------------------

    def norm(self, rows: list[PackedRow]) -> StepNorm:
        """The step's ``StepNorm`` from every one of its rows."""
        trains = [s for row in rows for s in row.samples if self._trains(s)]
        counts = StepCounts(sum(s.num_trained for s in trains), len(trains), len(rows))
        shift, scale = 0.0, 1.0
        if self.advantage_rule is not None:
            rollouts = {s.rollout_id: (s.reward, s.advantage) for row in rows for s in row.samples}
            rewards, advantages = np.array(list(rollouts.values()), dtype=np.float64).reshape(-1, 2).T
            shift, scale = step_affine(self.advantage_rule, rewards, advantages)
        return StepNorm(counts, shift, scale, self.entropy_coef)

    def batch(self, row: PackedRow, forward: Any, norm: StepNorm, reference: Tensor | None = None) -> LossBatch:
        """The LossBatch of one packed row from the trainer's forward (``logprobs``, ``top_logprobs``, ``entropy``)
        and the reference model's log-probabilities of its tokens (the KL penalty's: trainer/reference.py)."""
        device = forward.logprobs.device
        truncated = torch.tensor([s.sequence.truncated for s in row.samples], dtype=torch.bool)
        return LossBatch(
            logprobs=forward.logprobs,
            sampler_logprobs=row.sampler_logprobs.to(device),
            advantages=self._advantages(row, norm).to(device),
            mask=torch.ones_like(forward.logprobs, requires_grad=False),
            sequence_index=row.sequence_index.to(device),
            top_logprobs=forward.top_logprobs,
            sampler_top_logprobs=None if row.sampler_top_logprobs is None else row.sampler_top_logprobs.to(device),
            entropy=forward.entropy,
            truncated=truncated[row.sequence_index].to(device),
            ref_logprobs=reference,
        )

    def loss(
        self, batch: LossBatch, norm: StepNorm, aux_loss: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float], StepTotals]:
        """This micro-batch's part of the step loss (to backpropagate), the loss's metrics and its part of the
        step's totals; ``aux_loss``: the row's MoE load-balancing loss, added with router_aux_coef as this row's
        share of the step's mean."""
        result = self.loss_fn(batch)
        trained = batch.mask > 0
        if self.options.mask_truncated_completions and batch.truncated is not None:
            trained = trained & ~batch.truncated
        tokens = int(trained.sum()) if self.needs_tokens else 0
        loss = result.loss_sum / self._divisor(tokens, norm.counts)
        policy_loss = entropy_part = 0.0
        if result.entropy_mean is not None:
            policy_loss = float(loss.detach())
            share = tokens / max(norm.counts.tokens, 1)
            entropy = float(result.entropy_mean.detach())
            entropy_part = share * entropy
            loss = loss - self._coefficient(entropy, norm.entropy_coef) * share * result.entropy_mean
        metrics = result.metrics
        if aux_loss is not None and self.router_aux_coef:
            loss = loss + self.router_aux_coef * aux_loss / max(norm.counts.micro_batches, 1)
            metrics = {**metrics, "aux_loss": float(aux_loss.detach())}
        return loss, metrics, StepTotals(loss.detach(), policy_loss, entropy_part)  # the auxiliary part included

    def end_step(self, totals: StepTotals) -> dict[str, float]:
        """Step metrics from the step's totals over every rank (loss; policy_loss, entropy_coef when a bonus is
        on); moves the adaptive coefficient."""
        if not self.options.entropy_bonus:
            return {"loss": float(totals.loss)}
        metrics = {"loss": float(totals.loss), "policy_loss": totals.policy_loss, "entropy_coef": self.entropy_coef}
        o = self.options
        if o.entropy_target is not None:
            delta = o.entropy_coef_delta if totals.entropy <= o.entropy_target else -o.entropy_coef_delta
            self.entropy_coef = min(max(self.entropy_coef + delta, o.entropy_coef_min), o.entropy_coef_max)
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.entropy_coef} if self.options.entropy_target is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.options.entropy_target is not None and "entropy_coef" in state:
            self.entropy_coef = float(state["entropy_coef"])

    # ---- helpers -------------------------------------------------------------------------------------------

    def _trains(self, sample: RolloutSample) -> bool:
        return not (self.options.mask_truncated_completions and sample.sequence.truncated)

    def _divisor(self, tokens: int, counts: StepCounts) -> int:
        normalization = self.options.normalization
        if normalization == "sequence":
            return max(counts.sequences, 1)
        if normalization == "constant":
            return max(self.max_completion_length * counts.sequences, 1)
        if normalization == "micro_batch":
            return max(tokens, 1) * max(counts.micro_batches, 1)
        return max(counts.tokens, 1)

    def _coefficient(self, entropy: float, coef: float) -> float:
        target = self.options.entropy_target
        return coef if target is None or entropy <= target else 0.0

    def _advantages(self, row: PackedRow, norm: StepNorm) -> Tensor:
        if self.advantage_rule is None:
            return row.advantages
        scorable = torch.tensor([not math.isnan(s.reward) for s in row.samples], dtype=torch.bool)
        scaled = (row.advantages - norm.shift) / norm.scale
        return torch.where(scorable[row.sequence_index], scaled, 0).to(row.advantages.dtype)


def check_loss(loss_fn: PolicyLoss, top_k: int) -> None:
    """Run a built loss once on a two-slot batch, so an unsupported combination fails at validation, not mid-run."""
    top = None
    if "sampler_top_logprobs" in loss_fn.requires:
        top = torch.log(torch.full((2, max(top_k, 1)), 1 / (max(top_k, 1) + 1), dtype=torch.float64))
    loss_fn(LossBatch(
        logprobs=torch.tensor([-1.0, -2.0], dtype=torch.float64), sampler_logprobs=torch.tensor([-1.1, -1.9],
        dtype=torch.float64), advantages=torch.tensor([1.0, -1.0], dtype=torch.float64), mask=torch.ones(2,
        dtype=torch.float64), sequence_index=torch.tensor([0, 1]), top_logprobs=top, sampler_top_logprobs=top,
        entropy=torch.tensor([1.0, 0.5], dtype=torch.float64), truncated=torch.tensor([False, False]),
        ref_logprobs=torch.tensor([-1.05, -1.95], dtype=torch.float64),
    ))  # fmt: skip
