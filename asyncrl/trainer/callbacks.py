"""Hooks into the training loop (trainer.callbacks), after transformers' TrainerCallback.

``trainer.callbacks=[pkg.module:Class]`` names classes that the trainer instantiates with no arguments as it starts;
a bad import path fails before the server starts (plan/assemble.py). The hooks run on rank 0 only, in the trainer's
process and between steps (the other ranks wait for its next command). Each gets the run's config, its TrainerState
(step, model_version, ...: read it, do not change it) and the run's one ``TrainerControl``: a hook that sets
``control.should_training_stop`` ends the run as trainer.max_steps does (the last weight sync, evaluation, checkpoint
and model are saved and the report written).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config
from asyncrl.registry import RegistryError, import_object
from asyncrl.trainer.checkpoint import TrainerState

HOOKS = ("on_step_end", "on_log", "on_evaluate", "on_save")


@dataclass
class TrainerControl:
    """What a hook may ask of the loop (the flag of transformers' TrainerControl)."""

    should_training_stop: bool = False
    """The loop starts no further step, and the run ends as at trainer.max_steps."""


class TrainerCallback:
    """Subclass it and override the hooks you need (a class that defines some of them without it works too).

    Args:
        config: the run's resolved config.
        state: the trainer's progress; ``state.step`` counts optimizer steps (resumed runs included).
        control: set ``control.should_training_stop = True`` to end the run.
    """

    def on_step_end(self, config: Config, state: TrainerState, control: TrainerControl) -> None:
        """After each optimizer step and its weight sync, before its evaluation, logging and checkpoint."""

    def on_log(self, config: Config, state: TrainerState, control: TrainerControl, logs: dict[str, Any]) -> None:
        """After a logging step's metrics went to metrics.jsonl and the trackers; ``logs`` holds them (NaN: no event
        in the window)."""

    def on_evaluate(
        self, config: Config, state: TrainerState, control: TrainerControl, metrics: dict[str, float]
    ) -> None:
        """After each held-out evaluation (before training, at logging.eval_steps, at checkpoints with
        logging.eval_on_save, after training); ``metrics`` holds its eval/* values."""

    def on_save(self, config: Config, state: TrainerState, control: TrainerControl, checkpoint: Path) -> None:
        """After a checkpoint is written whole; ``checkpoint`` is its directory."""


def resolve_callback(path: str) -> type:
    """The class a trainer.callbacks entry names, checked without instantiating it: importable, a class defining at
    least one hook, callable with no arguments. Anything else is one ConfigError naming the key."""
    try:
        cls = import_object(path)
    except RegistryError as exc:
        raise ConfigError(f"trainer.callbacks: {exc}") from exc
    if not isinstance(cls, type) or not any(hasattr(cls, hook) for hook in HOOKS):
        raise ConfigError(f"trainer.callbacks: '{path}' is not a class with any of the hooks {', '.join(HOOKS)} "
                          "(subclass asyncrl.trainer.callbacks.TrainerCallback)")  # fmt: skip
    try:
        inspect.signature(cls).bind()
    except TypeError as exc:
        raise ConfigError(f"trainer.callbacks: '{path}' is instantiated with no arguments, but {exc}: give its "
                          "parameters defaults (or set them as class attributes)") from exc  # fmt: skip
    return cls


class Callbacks:
    """The run's callbacks in their trainer.callbacks order, sharing one TrainerControl: a stop one asks holds."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.callbacks = [(path, resolve_callback(path)()) for path in config.trainer.callbacks]
        self.control = TrainerControl()
        self.stopped_by: str | None = None
        """The entry whose hook first asked for the stop, for the line that says why the run ended."""

    def call(self, hook: str, state: TrainerState, **extra: Any) -> None:
        """``hook`` of every callback that defines it, with the config, ``state``, the control and ``extra``."""
        for path, callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self.config, state, self.control, **extra)
            if self.control.should_training_stop and self.stopped_by is None:
                self.stopped_by = path
