"""What a run prepares before anything starts: its datasets, with the evaluation switched off by its size, and
the components validation built, shared as they are and checked once to pickle."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config.compose import compose, to_config_and_components
from asyncrl.rollout.scoring import RewardSource
from asyncrl.rollout.spawn import UnpicklableError
from asyncrl.trainer.setup import check_components_pickle, prepare


def test_the_default_prepares_its_eval_split_and_zero_eval_prompts_turn_it_off():
    config, components = to_config_and_components(compose([]))
    prepared = prepare(config, components)
    assert prepared.eval_dataset is not None and prepared.components is components
    assert prepare(*to_config_and_components(compose(["data.num_eval_prompts=0"]))).eval_dataset is None


def test_a_component_that_cannot_reach_the_worker_fails_naming_it():
    _, components = to_config_and_components(compose(["reward=length"]))
    check_components_pickle(components)
    local = dataclasses.replace(components, rewards=[RewardSource("mine", lambda prompts, **_: [1.0] * len(prompts))])
    with pytest.raises(UnpicklableError, match="reward function 'mine'"):
        check_components_pickle(local)
