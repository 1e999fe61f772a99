"""Every dtype name the config accepts maps to one torch dtype, "auto" to none (as the checkpoint stores it)."""

from __future__ import annotations

import torch

from asyncrl.config.compose import compose
from asyncrl.config.schema import ModelDtype
from asyncrl.dtypes import DTYPES, torch_dtype
from asyncrl.plan.assemble import plan_run


def serving_dtype(overrides: list[str]) -> str:
    """The serving dtype the plan of ``overrides`` decides."""
    return plan_run(compose(overrides)).serving_dtype


def test_every_config_dtype_name_has_its_torch_dtype():
    assert set(DTYPES) | {"auto"} == {d.value for d in ModelDtype}
    assert torch_dtype("auto") is None and torch_dtype(ModelDtype.bfloat16) is torch.bfloat16


def test_the_server_computes_in_server_dtype_else_model_dtype():
    assert serving_dtype(["model.dtype=float16"]) == "float16"
    assert serving_dtype(["model.dtype=float16", "server.dtype=bfloat16"]) == "bfloat16"


def test_a_server_on_a_gpu_computes_in_16_bits_whatever_the_trainer_keeps(tmp_path):
    vllm = ["server=vllm", "model.name_or_path=Qwen/Qwen3-4B"]  # model.dtype float32: the trainer's master weights
    assert serving_dtype(vllm) == "bfloat16"
    assert serving_dtype([*vllm, "server.dtype=float32"]) == "float32"  # asked for
    assert serving_dtype(["server=builtin", "server.device=cuda"]) == "bfloat16"
    assert serving_dtype(["server=builtin", "server.device=cpu"]) == "float32"
    (tmp_path / "config.json").write_text('{"text_config": {"dtype": "float16"}}')
    assert serving_dtype(["server=vllm", f"model.name_or_path={tmp_path}"]) == "float16"
