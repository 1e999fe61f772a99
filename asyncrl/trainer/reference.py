"""The frozen reference policy of the KL penalty (loss.beta > 0): its log-probabilities of a step's trained tokens,
and TR-DPO's mixing of the policy into it (loss.sync_ref_model).

Every trainer rank builds one beside its policy (trainer/loop.py on rank 0, trainer/distributed.py's Follower on the
others), sharded as the policy is, and runs the same reference forwards, so that FSDP's collectives pair up. Under
LoRA the reference is the policy's own base with its adapters disabled: no second copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from asyncrl.config.schema import Config
from asyncrl.lora import is_peft
from asyncrl.losses.policy import PolicyOptions
from asyncrl.packing.row import PackedRow
from asyncrl.trainer import fsdp
from asyncrl.trainer.forward import trainer_forward
from asyncrl.trainer.model import load_model, mixed_precision_dtype


class Reference:
    """The reference of one rank: ``model``, a frozen sharded copy of the initial weights, or None for the LoRA
    ``policy``'s base."""

    def __init__(self, policy: torch.nn.Module, model: torch.nn.Module | None, options: PolicyOptions) -> None:
        self.policy, self.model, self.options = policy, model, options
        # steps ended since this process built it: a resumed run's reference starts again from the initial weights
        # and counts ref_model_sync_steps from there
        self.steps = 0

    def logprobs(self, row: PackedRow, config: Config) -> torch.Tensor:
        """[T] log pi_ref of the row's trained tokens, computed as the policy's are (sampling temperature, the
        sampler's candidate sets)."""
        with torch.no_grad(), self._network() as network:
            return trainer_forward(network, row, config).logprobs

    @contextmanager
    def _network(self) -> Iterator[torch.nn.Module]:
        if self.model is not None:
            yield self.model
            return
        with self.policy.disable_adapter():
            yield self.policy

    def end_step(self) -> None:
        """Count a step (all its optimizer passes); under sync_ref_model mix the policy in every
        ref_model_sync_steps steps."""
        self.steps += 1
        if self.options.sync_ref_model and self.steps % self.options.ref_model_sync_steps == 0:
            self.mix(self.options.ref_model_mixup_alpha)

    def mix(self, alpha: float) -> None:
        """TR-DPO: ref = alpha * policy + (1 - alpha) * ref, each rank on its own shards (both are sharded alike)."""
        if self.model is None:
            raise ValueError("loss.sync_ref_model: a LoRA run's reference is its base model, which cannot be mixed")
        with torch.no_grad():
            for ref, param in zip(self.model.parameters(), self.policy.parameters(), strict=True):
                ref.mul_(1 - alpha).add_(param.detach().to(ref.dtype), alpha=alpha)


def build_reference(config: Config, policy: torch.nn.Module, options: PolicyOptions) -> Reference | None:
    """The reference at loss.beta > 0 (None at 0): the LoRA policy's base, else model.name_or_path loaded again
    (a resumed run's too: the reference is the initial policy), frozen and sharded as the policy is."""
    if options.beta == 0:
        return None
    if is_peft(policy):
        return Reference(policy, None, options)
    model = load_model(config, config.model.name_or_path)
    model.requires_grad_(False).eval()
    return Reference(policy, fsdp.shard(model, config, mixed_precision_dtype(config)), options)


def reference_logprobs(reference: Reference | None, rows: list[PackedRow], config: Config) -> list[torch.Tensor] | None:
    """Each row's reference log-probabilities, once per step for all its passes (fillers included: every rank runs
    as many sharded forwards); None without a reference."""
    if reference is None:
        return None
    return [reference.logprobs(row, config) for row in rows]
