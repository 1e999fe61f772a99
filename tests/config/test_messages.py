"""Configuration errors as one line: the key, what it accepts, and for a misspelt key the group's real keys."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from asyncrl.config.compose import compose, to_config
from asyncrl.config.errors import ConfigError
from asyncrl.config.messages import check_run_dir, config_error_line
from asyncrl.config.schema import LrSchedulerType, ModelDtype

CASES = {
    "trainer.learning_rte=1e-6": "trainer.learning_rte: no such key (did you mean trainer.learning_rate?); the keys "
    "of settings group 'trainer': output_dir, seed, max_steps,",
    "trainr.max_steps=3": "trainr: no such key (did you mean trainer?); the keys of the config: model, sampling,",
    "model.dtype=bf16": "model.dtype: Invalid value 'bf16', expected one of [auto, float32, bfloat16, float16]",
    "trainer.lr_scheduler_type=cosinee": "trainer.lr_scheduler_type: Invalid value 'cosinee', expected one of "
    "[constant, constant_with_warmup, linear, cosine,",
    "staleness.max_staleness=lots": "staleness.max_staleness: Value 'lots' of type 'str' could not be converted",
    "loss=clipd": "In 'config': Could not find 'loss/clipd'; options: cispo, clipped,",
    "packing.attention=sdpa": "packing.attention: no such key (packing.attention is now trainer.attention: set "
    "trainer.attention instead)",
    "packing.compile_layers=false": "packing.compile_layers: no such key (packing.compile_layers is now "
    "trainer.compile_layers",
}


@pytest.mark.parametrize("override", list(CASES))
def test_a_bad_override_is_one_line_naming_the_key(override):
    with pytest.raises(Exception) as info:  # noqa: PT011 - Hydra and OmegaConf raise several types
        to_config(compose([override]))
    line = config_error_line(info.value)
    assert "\n" not in line and line.startswith(CASES[override]), line


def test_a_key_appended_to_a_settings_group_is_refused():
    """OmegaConf lets +group.key=value add a key that the dataclass then carries unread."""
    with pytest.raises(ConfigError, match=r"^sampling.temprature: no such key \(did you mean sampling.temperature\?\)"):
        to_config(compose(["+sampling.temprature=0.7"]))
    assert to_config(compose(["+model.model_init_kwargs.low_cpu_mem_usage=true"]))  # free-form mappings stay free


def test_every_scheduler_choice_builds_and_dtypes_format_as_their_value():
    """Each with the trainer.lr_scheduler_kwargs it cannot do without."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    needed = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
              "warmup_stable_decay": {"num_decay_steps": 2}}  # fmt: skip
    for choice in LrSchedulerType:
        get_scheduler(choice, optimizer, num_warmup_steps=1, num_training_steps=10,
                      scheduler_specific_kwargs=needed.get(choice))  # fmt: skip
    assert f"--dtype={ModelDtype.bfloat16}" == "--dtype=bfloat16"


def test_a_run_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=rf"^hydra.run.dir={tmp_path}/f/run: {tmp_path}/f is a file, not a dir"):
        check_run_dir(str(tmp_path / "f" / "run"), "hydra.run.dir")
    check_run_dir(str(tmp_path / "new" / "run"), "hydra.run.dir")
