"""Runtime LoRA adapters on the built-in server: vLLM's load/unload endpoints over peft adapters.

Adapters are peft adapters on the engine's transformers model: the model is wrapped in a PeftModel at the
first load and unwrapped when the last one leaves, and several adapters stay resident. A forward whose rows
use different adapters (or some the base weights) names each row's adapter (peft's mixed-batch forward,
``adapter_names=`` per row, ``__base__`` for the base), so they decode in the same continuous batch; a forward
whose rows all use one adapter runs it as peft's active adapter, about 20% faster on CPU. The limits mirror vLLM's
flags: at most ``max_loras`` adapters resident (vLLM would queue requests beyond that many per batch; here a
load beyond it is refused) and ranks up to ``max_lora_rank``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in adapter_names
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_ROOT = "base_model.model."
_WRAPPED = (".base_layer.", ".original_module.")


class AdapterNotFound(LookupError):
    """An unknown adapter name, or a path with no adapter in it (HTTP 404, like vLLM)."""


@dataclass(frozen=True, slots=True)
class LoraLimits:
    max_loras: int
    max_lora_rank: int


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    rank: int


def _rank(name: str, path: str) -> int:
    """The adapter's highest rank, read from its adapter_config.json."""
    config_file = Path(path) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterNotFound(f"Loading lora {name} failed: No adapter found for {path}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"Loading lora {name} failed: {path} holds a {config.get('peft_type')} adapter, not LoRA")
    return max([int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())])


class AdapterSet:
    """The adapters resident on one model; the engine calls it under its step lock."""

    def __init__(self, limits: LoraLimits, base_name: str) -> None:
        self.limits = limits
        self.base_name = base_name
        self.adapters: dict[str, Adapter] = {}
        self.requested: set[str] = set()
        """Adapters some request has named (the engine logs the first request under each)."""

    def check_load(self, name: str, path: str, load_inplace: bool) -> Adapter:
        """Validate a load request as vLLM does, before anything is read into the model."""
        if not name or not path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_name:
            raise ValueError(f"The lora adapter name '{name}' is the base model's name; choose another.")
        if name in self.adapters and not load_inplace:
            raise ValueError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True."
            )
        if name not in self.adapters and len(self.adapters) >= self.limits.max_loras:
            raise ValueError(
                f"Cannot load lora adapter '{name}': {len(self.adapters)} adapters are loaded, the "
                f"server holds at most --max-loras {self.limits.max_loras}; unload one first"
            )
        rank = _rank(name, path)
        if rank > self.limits.max_lora_rank:
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {self.limits.max_lora_rank}.")
        return Adapter(name, path, rank)

    def check_unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")

    def attach(self, model: torch.nn.Module, adapter: Adapter) -> torch.nn.Module:
        """Read ``adapter`` into the model (wrapping it at the first adapter); returns the model to run."""
        from peft import PeftModel

        device = str(next(model.parameters()).device)
        options = {"autocast_adapter_dtype": False, "torch_device": device}
        if adapter.name in self.adapters:
            model = self.detach(model, adapter.name)
        if not isinstance(model, PeftModel):
            model = PeftModel.from_pretrained(model, adapter.path, adapter_name=adapter.name, **options)
        else:
            model.load_adapter(adapter.path, adapter_name=adapter.name, **options)
        self.adapters[adapter.name] = adapter
        return model.eval()

    def detach(self, model: torch.nn.Module, name: str) -> torch.nn.Module:
        """Drop one adapter's weights; the last one leaves the plain base model behind."""
        del self.adapters[name]
        self.requested.discard(name)
        if not self.adapters:
            return model.unload()
        with warnings.catch_warnings():  # peft warns when the active adapter goes; the next forward picks one
            warnings.simplefilter("ignore")
            model.delete_adapter(name)
        return model

    def select(self, model: torch.nn.Module, adapters: list[str | None]) -> dict[str, Any]:
        """Make the next forward run each row under its adapter; returns the forward's extra arguments. Rows all
        under one adapter run it as peft's active adapter (the fast path); mixed rows name theirs per row."""
        if not self.adapters:
            return {}
        distinct = set(adapters)
        if len(distinct) == 1 and None not in distinct:
            name = distinct.pop()
            if model.active_adapter != name:
                model.set_adapter(name)
            return {}
        return {"adapter_names": [name or BASE_ADAPTER for name in adapters]}

    def cards(self, created: int) -> list[dict[str, Any]]:
        """vLLM's /v1/models cards for LoRA adapters."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "asyncrl",
                "root": a.path,
                "parent": self.base_name,
                "max_model_len": None,
                "permission": [],
            }
            for a in self.adapters.values()
        ]


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under their own names, also while adapters wrap its layers (weight updates)."""
    state = {}
    for name, tensor in model.state_dict().items():
        name = name.removeprefix(_PEFT_ROOT)
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        for wrapped in _WRAPPED:
            name = name.replace(wrapped, ".")
        state[name] = tensor
    return state
