"""Training-loop callbacks the end-to-end tests name by import path (trainer.callbacks)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from asyncrl.config.schema import Config
from asyncrl.trainer.callbacks import TrainerCallback, TrainerControl
from asyncrl.trainer.checkpoint import TrainerState

LOG_ENV = "ASYNCRL_TEST_CALLBACK_LOG"
STOP_ENV = "ASYNCRL_TEST_STOP_AT_STEP"


class RecordHooks(TrainerCallback):
    """Appends each hook call (its name, the step and what it was given) as a JSON line to $ASYNCRL_TEST_CALLBACK_LOG,
    and asks the run to stop after step $ASYNCRL_TEST_STOP_AT_STEP (if set)."""

    def _record(self, hook: str, state: TrainerState, **seen: Any) -> None:
        with Path(os.environ[LOG_ENV]).open("a") as f:
            f.write(json.dumps({"hook": hook, "step": state.step, **seen}) + "\n")

    def on_step_end(self, config: Config, state: TrainerState, control: TrainerControl) -> None:
        self._record("on_step_end", state)
        if os.environ.get(STOP_ENV) and state.step >= int(os.environ[STOP_ENV]):
            control.should_training_stop = True

    def on_log(self, config: Config, state: TrainerState, control: TrainerControl, logs: dict[str, Any]) -> None:
        self._record("on_log", state, has_reward="reward" in logs)

    def on_evaluate(
        self, config: Config, state: TrainerState, control: TrainerControl, metrics: dict[str, float]
    ) -> None:
        self._record("on_evaluate", state, metrics=sorted(metrics))

    def on_save(self, config: Config, state: TrainerState, control: TrainerControl, checkpoint: Path) -> None:
        self._record("on_save", state, checkpoint=checkpoint.name, whole=(checkpoint / "trainer_state.json").is_file())
