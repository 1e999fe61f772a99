"""What a run prepares before anything starts: its datasets, with the evaluation switched off by its size, and
the components validation built, shared as they are and checked once to pickle."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.rollout.scoring import RewardSource
from asyncrl.rollout.spawn import UnpicklableError
from asyncrl.trainer.setup import check_components_pickle, prepare


def test_the_default_prepares_its_eval_split_and_zero_eval_prompts_turn_it_off():
    plan = plan_run(compose([]))
    components = plan.components
    prepared = prepare(plan)
    assert prepared.eval_dataset is not None and prepared.components is components
    assert prepare(plan_run(compose(["data.num_eval_prompts=0"]))).eval_dataset is None


def test_a_component_that_cannot_reach_the_worker_fails_naming_it():
    components = plan_run(compose(["reward=length"])).components
    check_components_pickle(components)
    local = dataclasses.replace(components, rewards=[RewardSource("mine", lambda prompts, **_: [1.0] * len(prompts))])
    with pytest.raises(UnpicklableError, match="reward function 'mine'"):
        check_components_pickle(local)
