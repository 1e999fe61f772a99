"""The reward's ``trainer_state``: TRL's field names, made without importing transformers' Trainer stack."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from transformers import TrainerState

from asyncrl.config.schema import Config
from asyncrl.rollout.trainer_state import RolloutState, rollout_state

# Scores one group with every built-in reward (each takes **columns, so each is offered the state, as TRL offers it)
# and prints whether the Trainer's modules were imported on the way.
SCORE_WITH_THE_BUILT_IN_REWARDS = """
import asyncio, sys
from asyncrl.components import build_components
from asyncrl.config.compose import compose, to_config
from asyncrl.rollout.scoring import score_group
from asyncrl.rollout.trainer_state import rollout_state
from asyncrl.rollout.types import RolloutGroup

config = to_config(compose(["reward_funcs=[{name: length}, {name: accuracy}, {name: format}]"]))
group = RolloutGroup(
    prompts=[[{"role": "user", "content": "What is 2 + 2?"}]] * 2, reward_kwargs={"solution": ["4", "4"]},
    completions=[[{"role": "assistant", "content": c}] for c in ("<think>x</think>\\\\boxed{4}", "5")],
    completions_ids=[[1, 2], [3]], completions_sequences=[[], []], tool_call_counts=[0, 0],
    tool_failure_counts=[0, 0], model_version=0, group_id=0, row_index=0, env_rewards=[None, None],
    rollout_rewards=[None, None],
)
sources = build_components(config).rewards
asyncio.run(score_group(group, sources, lambda: rollout_state(config, 1, 0, 10)))
print(sorted(m for m in ("transformers.trainer_callback", "transformers.trainer", "peft") if m in sys.modules))
"""


def test_the_state_has_every_field_of_transformers_trainer_state():
    ours = {f.name for f in dataclasses.fields(RolloutState)}
    assert {f.name for f in dataclasses.fields(TrainerState)} <= ours
    assert ours - {f.name for f in dataclasses.fields(TrainerState)} == {"model_version", "prompts_seen"}


def test_the_state_follows_the_config_and_the_groups_place():
    config = Config()
    config.staleness.weight_sync_steps, config.trainer.max_steps, config.logging.eval_steps = 2, 100, 10
    state = rollout_state(config, model_version=3, prompt_index=15, num_rows=10)
    assert (state.global_step, state.max_steps, state.epoch, state.eval_steps) == (6, 100, 1.5, 10)
    assert (state.model_version, state.prompts_seen, state.log_history) == (3, 15, [])


def test_scoring_with_the_built_in_rewards_never_imports_the_trainer_stack():
    """Importing transformers' TrainerState on the worker's event loop held up every run's first group by 7-9 s."""
    done = subprocess.run([sys.executable, "-c", SCORE_WITH_THE_BUILT_IN_REWARDS], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
