"""Composition of the config tree: defaults, every group option, recipes, overrides, typed schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf.errors import ValidationError

from asyncrl.config import Config
from asyncrl.config.compose import compose, conf_dir, to_config
from asyncrl.config.schema import ServerBackend

GROUP_OPTIONS = sorted(
    (group.name, option.stem)
    for group in conf_dir().iterdir()
    if group.is_dir() and group.name != "recipe"
    for option in group.glob("*.yaml")
)
RECIPES = sorted((conf_dir() / "recipe").glob("*.yaml"))


def test_defaults_are_the_embedded_default_with_spec_values():
    config = to_config(compose())
    assert isinstance(config, Config)
    assert Path(config.model.name_or_path).is_dir()  # the shipped tiny model
    assert config.staleness.max_staleness == 4
    assert config.staleness.weight_sync_steps == 1
    assert config.staleness.max_concurrent_rollouts == 512
    assert config.staleness.rollout_worker_timeout == 300
    assert config.sampling.num_sampler_logprobs == 8
    assert config.loss["name"] == "clipped"  # the embedded default's (conf/loss/tiny_arith.yaml says why)
    assert config.loss["is_clip_min"] == 0.5 and config.loss["is_clip_max"] == 5.0
    assert config.server.timeout == 1800
    assert to_config(compose(["+recipe=deepmath"])).loss["name"] == "score_centering"  # the spec's default loss


def test_spec_defaults_of_groups_that_the_embedded_default_overrides():
    config = to_config(compose(["sampling=default", "trainer=default"]))
    assert config.sampling.num_generations == 8
    assert config.sampling.max_completion_length == 2048
    assert config.trainer.learning_rate == 1e-6
    assert config.trainer.lr_scheduler_type == "constant"
    assert config.trainer.gradient_checkpointing is True


def test_group_options_exist_for_every_settings_group():
    groups = {g for g, _ in GROUP_OPTIONS}
    expected = {"model", "sampling", "staleness", "lora", "server", "trainer", "data", "reward", "loss", "packing",
                "logging", "advantage", "rollout"}  # fmt: skip
    assert expected <= groups


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=lambda v: str(v))
def test_every_group_option_composes_and_validates(group, option):
    config = to_config(compose([f"{group}={option}"]))
    assert isinstance(config, Config)


def test_recipes_exist():
    assert len(RECIPES) >= 1


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_composes_and_validates(recipe):
    assert isinstance(to_config(compose([f"+recipe={recipe.stem}"])), Config)


def test_deepmath_recipe_selects_the_real_model_data_and_vllm():
    config = to_config(compose(["+recipe=deepmath", "sampling.temperature=0.7"]))
    assert config.model.name_or_path == "Qwen/Qwen3.5-2B"
    assert config.data.path == "trl-lib/DeepMath-103K"
    assert config.server.backend == ServerBackend.vllm
    assert config.reward_funcs == [{"name": "accuracy"}]
    assert config.sampling.temperature == 0.7
    assert config.trainer.learning_rate == 1e-6  # the tiny default's lr does not leak into the recipe


def test_overrides_and_deletion():
    cfg = compose(
        ["trainer.learning_rate=3e-6", "~loss.is_clip_max", "+model.model_init_kwargs.low_cpu_mem_usage=true"]
    )
    config = to_config(cfg)
    assert config.trainer.learning_rate == 3e-6
    assert "is_clip_max" not in config.loss  # the loss function's own default applies
    assert config.model.model_init_kwargs == {"low_cpu_mem_usage": True}


def test_unknown_key_fails_at_composition():
    with pytest.raises((ConfigCompositionException, HydraException)) as info:
        compose(["trainer.learning_rte=1e-6"])
    assert "learning_rte" in str(info.value)


def test_wrong_type_fails_at_composition():
    with pytest.raises((ValidationError, ConfigCompositionException, HydraException)) as info:
        compose(["staleness.max_staleness=lots"])
    assert "max_staleness" in str(info.value)


def test_bad_enum_value_fails_and_names_the_choices():
    with pytest.raises((ValidationError, ConfigCompositionException, HydraException)) as info:
        compose(["server.backend=sglang"])
    assert "backend" in str(info.value)


def test_unknown_recipe_lists_available_ones():
    with pytest.raises((ConfigCompositionException, HydraException)) as info:
        compose(["+recipe=nope"])
    assert "deepmath" in str(info.value)


@pytest.mark.parametrize(
    ("group", "choices"),
    [
        ("loss", ["cispo", "clipped", "gspo", "luspo", "sapo", "score_centering", "vespo"]),
        ("packing", ["flat", "tree"]),  # packing/tiny_arith is tree with another budget
        ("model", ["qwen3_4b", "qwen3_5_2b", "tiny_arith"]),  # a model of its own
    ],
)
def test_a_missing_option_lists_the_groups_choices_not_their_presets(group, choices):
    with pytest.raises(MissingConfigException) as error:
        compose([f"{group}=nosuch"])
    assert error.value.options == choices
