"""trainer.callbacks: a bad entry is one line naming the key before anything starts, each hook gets the step and what
it is about, and a stop one hook asks holds for the run (the loop ending on it: tests/e2e/test_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.plan.assemble import plan_run
from asyncrl.trainer.callbacks import Callbacks, TrainerCallback
from asyncrl.trainer.checkpoint import TrainerState


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_step_end(self, config, state, control):
        self.seen.append(("step_end", state.step))

    def on_log(self, config, state, control, logs):
        self.seen.append(("log", state.step, logs))

    def on_evaluate(self, config, state, control, metrics):
        self.seen.append(("evaluate", state.step, metrics))

    def on_save(self, config, state, control, checkpoint):
        self.seen.append(("save", state.step, checkpoint))


class StopAtStepTwo:
    """No base class: a class defining a hook is enough."""

    def on_step_end(self, config, state, control):
        control.should_training_stop = state.step >= 2


class NeedsAName(TrainerCallback):
    def __init__(self, name: str) -> None:
        self.name = name


class NoHooks:
    pass


def not_a_class(config, state, control):
    pass


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("no_such_package.callbacks:Cls", "cannot import module 'no_such_package.callbacks'"),
        (f"{__name__}:Missing", f"module '{__name__}' has no attribute 'Missing'"),
        (f"{__name__}:NoHooks", "is not a class with any of the hooks on_step_end, on_log, on_evaluate, on_save"),
        (f"{__name__}:not_a_class", "is not a class with any of the hooks"),
        (f"{__name__}:NeedsAName", "is instantiated with no arguments, but missing a required argument: 'name'"),
    ],
    ids=["module", "attribute", "no-hooks", "function", "arguments"],
)
def test_a_bad_entry_fails_at_planning_in_one_line_naming_the_key(entry, says):
    with pytest.raises(ConfigError) as info:
        plan_run(compose([f"trainer.callbacks=['{entry}']"]))
    message = str(info.value)
    assert message.startswith("trainer.callbacks: ") and says in message and "\n" not in message


def test_each_hook_gets_the_step_and_its_subject_and_a_stop_holds_for_every_callback():
    config = to_config(compose([f"trainer.callbacks=['{__name__}:StopAtStepTwo','{__name__}:Recorder']"]))
    callbacks = Callbacks(config)
    state = TrainerState(step=1, model_version=1, prompt_index=0, prompts_consumed=0, extra={})
    checkpoint = Path("checkpoints/step_000001")
    callbacks.call("on_step_end", state)
    callbacks.call("on_log", state, logs={"reward": 0.5})
    callbacks.call("on_evaluate", state, metrics={"eval/greedy_reward": 0.25})
    callbacks.call("on_save", state, checkpoint=checkpoint)
    assert not callbacks.control.should_training_stop and callbacks.stopped_by is None
    state.step = 2
    callbacks.call("on_step_end", state)
    assert callbacks.control.should_training_stop and callbacks.stopped_by == f"{__name__}:StopAtStepTwo"
    recorder = callbacks.callbacks[1][1]
    assert recorder.seen == [
        ("step_end", 1), ("log", 1, {"reward": 0.5}), ("evaluate", 1, {"eval/greedy_reward": 0.25}),
        ("save", 1, checkpoint), ("step_end", 2),
    ]  # fmt: skip


def test_no_callbacks_is_the_default_and_never_stops():
    callbacks = Callbacks(to_config(compose([])))
    callbacks.call("on_step_end", TrainerState(step=1, model_version=1, prompt_index=0, prompts_consumed=0, extra={}))
    assert callbacks.callbacks == [] and not callbacks.control.should_training_stop
