"""What a run prepares before anything starts: its datasets, with the evaluation switched off by its size, and
the components validation built, shared as they are and checked once to pickle; trainer.tf32 without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.plan.assemble import plan_run
from asyncrl.rollout.scoring import RewardSource
from asyncrl.rollout.spawn import UnpicklableError
from asyncrl.trainer.setup import check_components_pickle, check_tf32_device, prepare


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


def test_tf32_on_a_machine_without_a_gpu_is_refused_before_the_server_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer.tf32=true: TF32 is a mode of NVIDIA GPUs .* drop trainer.tf32$"):
        prepare(plan_run(compose(["trainer.tf32=true"])))
    check_tf32_device(to_config(compose(["trainer.tf32=false"])))  # false: nothing to switch off, as transformers


def test_image_prompts_need_a_vision_language_checkpoint(tmp_path):
    from datasets import Dataset

    from asyncrl.assets.tiny_vlm import save_tiny_vlm
    from asyncrl.trainer.setup import check_images

    vlm = save_tiny_vlm(tmp_path / "vlm")
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "How many?"}], "image": "a.png"}])
    text = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "image": None}])

    def config(*overrides: str):
        return to_config(compose(["data.path=train.jsonl", *overrides]))

    check_images(config(), text, None)  # no images: no checkpoint read
    with pytest.raises(ConfigError, match=r"^data.path=train.jsonl has images, and model.name_or_path=.* text-only"):
        check_images(config(), rows, None)
    check_images(config(f"model.name_or_path={vlm}"), rows, None)
    check_images(config(f"model.name_or_path={vlm}", "rollout.tools=[math:sqrt]"), rows, None)
    with pytest.raises(ConfigError, match=r"^data.eval_path=eval.jsonl has images"):
        check_images(config("data.eval_path=eval.jsonl"), text, rows)


def test_image_prompts_prepare_for_several_trainer_ranks():
    """Two ranks train images (a text row beside another rank's images runs a dummy one: trainer/distributed.py)."""
    plan = plan_run(compose(["+recipe=shapes", "trainer.num_processes=2"]))
    assert plan.world_size == 2
    assert prepare(plan).dataset.num_rows > 0
