"""Every dtype name the config accepts maps to one torch dtype, "auto" to none (as the checkpoint stores it)."""

from __future__ import annotations

import torch

from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import ModelDtype
from asyncrl.dtypes import DTYPES, torch_dtype
from asyncrl.server.command import serving_dtype


def test_every_config_dtype_name_has_its_torch_dtype():
    assert set(DTYPES) | {"auto"} == {d.value for d in ModelDtype}
    assert torch_dtype("auto") is None and torch_dtype(ModelDtype.bfloat16) is torch.bfloat16


def test_the_server_computes_in_server_dtype_else_model_dtype():
    assert serving_dtype(to_config(compose(["model.dtype=float16"]))) == "float16"
    assert serving_dtype(to_config(compose(["model.dtype=float16", "server.dtype=bfloat16"]))) == "bfloat16"
