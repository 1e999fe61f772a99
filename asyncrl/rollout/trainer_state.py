"""The ``trainer_state`` a reward function gets, as TRL's GRPOTrainer hands its own ``TrainerState``.

The rewards run in the rollout worker, a process apart from the trainer, so the state is built from what the worker
knows of the group it scores: the weight version that generated it and the group's place in the prompt stream. A
curriculum written for TRL reads ``global_step``, ``max_steps`` and ``epoch`` as it does there.

``RolloutState`` has ``transformers.TrainerState``'s fields without being one: importing that class loads the
Trainer's stack (peft among it), 7-9 s of a CPU on the worker's event loop at the first scored group of every run,
and TRL offers the state to every reward that takes ``**kwargs``, the built-in ones included
(tests/rollout/test_trainer_state.py holds both: the same field names, and no Trainer import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config.schema import Config


@dataclass
class RolloutState:
    """transformers' TrainerState fields, with ``global_step`` the optimizer step whose weights generated the group
    (its weight version x staleness.weight_sync_steps: the trainer may be up to staleness.max_staleness steps
    further) and ``epoch`` the group's place in the prompt stream in epochs (1.5: half-way through the second)."""

    epoch: float = 0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: list[Any] | None = None
    model_version: int = 0
    """The weight version that generated the group (weight syncs done when it started)."""
    prompts_seen: int = 0
    """Prompts of the stream before the group's own, earlier epochs and launches included (x num_generations: the
    samples generated before it, dropped groups included)."""


def rollout_state(config: Config, model_version: int, prompt_index: int, num_rows: int | None) -> RolloutState:
    """The state a group generated under ``model_version`` for the ``prompt_index``-th prompt of a stream of
    ``num_rows``-row epochs gives its reward functions; None: a streamed split before its first pass ended (epoch 0)."""
    t = config.trainer
    return RolloutState(
        epoch=prompt_index / max(num_rows, 1) if num_rows is not None else 0.0,
        global_step=model_version * config.staleness.weight_sync_steps,
        max_steps=max(t.max_steps, 0),
        logging_steps=t.logging_steps,
        eval_steps=config.logging.eval_steps or 0,
        save_steps=t.save_steps,
        model_version=model_version,
        prompts_seen=prompt_index,
    )
