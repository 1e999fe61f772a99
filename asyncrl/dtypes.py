"""The torch dtypes that the config's and command lines' dtype names (``ModelDtype``) stand for; which one a
server runs in is serving/command.py's ``serving_dtype``."""

from __future__ import annotations

import torch

from asyncrl.config.schema import ModelDtype

DTYPES: dict[str, torch.dtype] = {
    ModelDtype.float32: torch.float32,
    ModelDtype.bfloat16: torch.bfloat16,
    ModelDtype.float16: torch.float16,
}
"""Every dtype a model can be loaded, served or exported in; "auto" (as the checkpoint stores it) aside."""


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype ``name`` stands for; None for "auto"."""
    return None if name == ModelDtype.auto else DTYPES[name]
