"""The ``trainer_state`` a reward function gets, as TRL's GRPOTrainer hands its own ``TrainerState``.

The rewards run in the rollout worker, a process apart from the trainer, so the state is built from what the worker
knows of the group it scores: the weight version that generated it and the group's place in the prompt stream. A
curriculum written for TRL reads ``global_step``, ``max_steps`` and ``epoch`` as it does there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config.schema import Config


@functools.cache
def state_class() -> type:
    """transformers' TrainerState, with ``global_step`` the optimizer step whose weights generated the group (its
    weight version x staleness.weight_sync_steps: the trainer may be up to staleness.max_staleness steps further)
    and ``epoch`` the group's place in the prompt stream in epochs (1.5: half-way through the second). Made on first
    use: ``transformers.TrainerState`` imports the Trainer's stack (peft among it), 9 s of the rollout worker's start
    on a CPU when imported with the module, for rewards that mostly never ask for it."""
    from transformers import TrainerState

    @dataclass
    class RolloutState(TrainerState):
        model_version: int = 0
        """The weight version that generated the group (weight syncs done when it started)."""
        prompts_seen: int = 0
        """Prompts of the stream before the group's own, earlier epochs and launches included (x num_generations:
        the samples generated before it, dropped groups included)."""

    return RolloutState


def rollout_state(config: Config, model_version: int, prompt_index: int, num_rows: int) -> Any:
    """The state a group generated under ``model_version`` for the ``prompt_index``-th prompt of a stream of
    ``num_rows``-row epochs gives its reward functions."""
    t = config.trainer
    return state_class()(
        epoch=prompt_index / max(num_rows, 1),
        global_step=model_version * config.staleness.weight_sync_steps,
        max_steps=max(t.max_steps, 0),
        logging_steps=t.logging_steps,
        save_steps=t.save_steps,
        model_version=model_version,
        prompts_seen=prompt_index,
    )
