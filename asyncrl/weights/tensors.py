"""The trainer's weights as the server wants them: named tensors in the serving dtype, each storage once.

A peft model is sent merged: each adapted layer's base weight plus its adapters' delta, under the base
model's parameter names, so a server that knows nothing of adapters loads it like a full fine-tune. A
vision-language model's frozen vision tower and projector are never sent: the server keeps what it loaded (with
model.freeze_vision_tower=false they train, and are sent like the rest).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from asyncrl import lora
from asyncrl.model_kind import non_text_prefixes


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a DistributedDataParallel-style wrapper, whose names carry a "module." prefix."""
    return getattr(model, "module", model)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def whole_tensors(model: Any) -> tuple[torch.nn.Module, Callable[[str], torch.Tensor]]:
    """The module behind ``model`` and a reader of its whole parameters by name: gathered for the trainer's sharded
    view (trainer/fsdp.py's GatheredModel, known by its ``sharded_parameters``), the parameters themselves for an
    unsharded module."""
    if hasattr(model, "sharded_parameters"):
        return model.model, model.full
    params = dict(model.named_parameters())
    return model, lambda name: params[name].detach()


def frozen_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """Base-model name prefixes that sync skips: a vision-language model's modules outside its text model that do
    not train. The trainer froze them or not when it loaded the model (model.freeze_vision_tower:
    trainer/model.py::freeze_non_text), so the sync follows that one decision and sends a trained tower."""
    inner, _ = whole_tensors(model)
    base = inner.get_base_model() if lora.is_peft(inner) else inner
    return tuple(prefix for prefix in non_text_prefixes(base)
                 if not any(p.requires_grad for p in base.get_submodule(prefix[:-1]).parameters()))  # fmt: skip


def _served(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Base-model names and tensors, merged when ``model`` carries adapters; each source storage once; none of
    the frozen non-text modules."""
    inner, full = whole_tensors(model)
    pairs = lora.merged_tensors(inner, named, full) if lora.is_peft(inner) else ((n, t, t) for n, t in named)
    unique = getattr(model, "yields_unique_tensors", False)  # gathered shards (trainer/fsdp.py): addresses repeat
    skipped = frozen_prefixes(model)
    seen: set[int] = set()
    for name, tensor, source in pairs:
        if (unique or source.data_ptr() not in seen) and not name.startswith(skipped):
            seen.add(source.data_ptr())
            yield name, tensor


def serving_parameters(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-named parameters (tied weights once, under their first name), cast to ``dtype``."""
    model = _unwrap(model)
    for name, param in _served(model, model.named_parameters()):
        yield name, _cast(param, dtype)


def parameter_metadata(model: torch.nn.Module, dtype: torch.dtype | None) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, wire dtype, shape) of what ``serving_parameters`` yields, without copying (or merging) anything."""
    model = _unwrap(model)
    peft, skipped = lora.is_peft(whole_tensors(model)[0]), frozen_prefixes(model)
    metadata = []
    named = getattr(model, "sharded_parameters", model.named_parameters)  # shapes without gathering shards
    for name, param in named():
        served = lora.base_name(name) if peft else name
        if served is not None and not served.startswith(skipped):
            wire = dtype if dtype is not None and param.is_floating_point() else param.dtype
            metadata.append((served, wire, list(param.shape)))
    return metadata


def parameter_device(model: torch.nn.Module) -> torch.device:
    """Where the weights live: a plain model's first parameter, or the first shard of the trainer's gathered view
    (trainer/fsdp.py's GatheredModel, which has no ``parameters()``)."""
    model = _unwrap(model)
    named = getattr(model, "sharded_parameters", model.named_parameters)
    return next(iter(named()))[1].device


def serving_bytes(model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes of what ``serving_parameters`` yields: the payload of one full weight sync."""
    return sum(math.prod(shape) * wire.itemsize for _, wire, shape in parameter_metadata(model, dtype))


def unique_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name on the CPU, each storage once (tied weights under their first name)."""
    model = _unwrap(model)
    served = _served(model, model.state_dict().items())
    return {name: _cast(tensor, dtype).contiguous().cpu() for name, tensor in served}
