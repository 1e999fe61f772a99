"""The trainer's side of the loss: each micro-batch's ``loss_sum`` becomes its share of the step's loss.

Per optimizer step the trainer calls ``start_step(rows)``, then for every row ``batch(row, forward)`` and
``step_loss(batch)`` (it backpropagates the returned tensor), then ``end_step()``. ``StepLoss`` owns what
needs the whole step: the normaliser, the entropy bonus and its adaptive coefficient (checkpointed through
``state_dict``), and the step-level part of advantage estimators that normalise over a batch.
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


@dataclass
class StepCounts:
    tokens: int = 0
    """Trained tokens of the step, less those of completions dropped by mask_truncated_completions."""
    sequences: int = 0
    micro_batches: int = 0


class StepLoss:
    """Normalise, add the entropy bonus, finish step-level advantages; one instance per run.

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
        self.start_step([])

    # ---- per step ------------------------------------------------------------------------------------------

    def start_step(self, rows: list[PackedRow]) -> None:
        trains = [s for row in rows for s in row.samples if self._trains(s)]
        self.counts = StepCounts(sum(s.num_trained for s in trains), len(trains), len(rows))
        self.shift, self.scale = 0.0, 1.0
        if self.advantage_rule is not None:
            rollouts = {s.rollout_id: (s.reward, s.advantage) for row in rows for s in row.samples}
            rewards, advantages = np.array(list(rollouts.values()), dtype=np.float64).reshape(-1, 2).T
            self.shift, self.scale = step_affine(self.advantage_rule, rewards, advantages)
        self.policy_loss = self.entropy = 0.0
        self.loss: Tensor | float = 0.0
        """The step's loss so far: the sum of the micro-batches' backpropagated parts, kept on the device."""

    def batch(self, row: PackedRow, forward: Any) -> LossBatch:
        """The LossBatch of one packed row from the trainer's forward (``logprobs``, ``top_logprobs``, ``entropy``)."""
        device = forward.logprobs.device
        truncated = torch.tensor([s.sequence.truncated for s in row.samples], dtype=torch.bool)
        return LossBatch(
            logprobs=forward.logprobs,
            sampler_logprobs=row.sampler_logprobs.to(device),
            advantages=self._advantages(row).to(device),
            mask=torch.ones_like(forward.logprobs, requires_grad=False),
            sequence_index=row.sequence_index.to(device),
            top_logprobs=forward.top_logprobs,
            sampler_top_logprobs=None if row.sampler_top_logprobs is None else row.sampler_top_logprobs.to(device),
            entropy=forward.entropy,
            truncated=truncated[row.sequence_index].to(device),
        )

    def __call__(self, batch: LossBatch, aux_loss: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """This micro-batch's part of the step loss (to backpropagate) and the loss's metrics; ``aux_loss``: the
        row's MoE load-balancing loss, added with router_aux_coef as this row's share of the step's mean."""
        result = self.loss_fn(batch)
        trained = batch.mask > 0
        if self.options.mask_truncated_completions and batch.truncated is not None:
            trained = trained & ~batch.truncated
        tokens = int(trained.sum()) if self.needs_tokens else 0
        loss = result.loss_sum / self._divisor(tokens)
        if result.entropy_mean is not None:
            self.policy_loss += float(loss.detach())
            share = tokens / max(self.counts.tokens, 1)
            entropy = float(result.entropy_mean.detach())
            self.entropy += share * entropy
            loss = loss - self._coefficient(entropy) * share * result.entropy_mean
        metrics = result.metrics
        if aux_loss is not None and self.router_aux_coef:
            loss = loss + self.router_aux_coef * aux_loss / max(self.counts.micro_batches, 1)
            metrics = {**metrics, "aux_loss": float(aux_loss.detach())}
        self.loss = self.loss + loss.detach()  # the step's whole loss, the auxiliary part included
        return loss, metrics

    def end_step(self) -> dict[str, float]:
        """Step metrics (loss; policy_loss, entropy_coef when a bonus is on); moves the adaptive coefficient."""
        if not self.options.entropy_bonus:
            return {"loss": float(self.loss)}
        metrics = {"loss": float(self.loss), "policy_loss": self.policy_loss, "entropy_coef": self.entropy_coef}
        o = self.options
        if o.entropy_target is not None:
            delta = o.entropy_coef_delta if self.entropy <= o.entropy_target else -o.entropy_coef_delta
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

    def _divisor(self, tokens: int) -> int:
        counts, normalization = self.counts, self.options.normalization
        if normalization == "sequence":
            return max(counts.sequences, 1)
        if normalization == "constant":
            return max(self.max_completion_length * counts.sequences, 1)
        if normalization == "micro_batch":
            return max(tokens, 1) * max(counts.micro_batches, 1)
        return max(counts.tokens, 1)

    def _coefficient(self, entropy: float) -> float:
        target = self.options.entropy_target
        return self.entropy_coef if target is None or entropy <= target else 0.0

    def _advantages(self, row: PackedRow) -> Tensor:
        if self.advantage_rule is None:
            return row.advantages
        scorable = torch.tensor([not math.isnan(s.reward) for s in row.samples], dtype=torch.bool)
        scaled = (row.advantages - self.shift) / self.scale
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
    ))  # fmt: skip
