"""What kind of checkpoint a model is, from its config alone: vision-language (a vision tower around a text model)
or text-only, and the transformers auto class that loads it whole. Shared by the trainer, the built-in server,
the vLLM launch and export, so that every side loads the same class and names the weights alike."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def is_vision_language(model_config: Any) -> bool:
    """A checkpoint with a vision part (its config has a ``vision_config``: Qwen3.5/3.6, Qwen3-VL, Gemma 3, LLaVA):
    it loads with AutoModelForImageTextToText, and asyncrl trains its text model only unless
    model.freeze_vision_tower=false."""
    return getattr(model_config, "vision_config", None) is not None


def local_config_json(name_or_path: str, revision: str | None = None) -> dict[str, Any] | None:
    """A checkpoint's config.json from its directory or the Hub cache, without the network; None when neither has it
    (or it is not JSON)."""
    path: Path | None = Path(name_or_path) / "config.json"
    if not Path(name_or_path).is_dir():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        except ValueError:  # not a Hub id either (a missing directory): the model path check names it
            return None
        path = Path(cached) if isinstance(cached, str) else None
    if path is None or not path.is_file():
        return None
    try:
        return dict(json.loads(path.read_text()))
    except ValueError:
        return None


def config_field(config_json: dict[str, Any], keys: tuple[str, ...], kind: type) -> Any:
    """The first of ``keys`` a config.json sets to a ``kind`` value, at its top or, for a vision-language checkpoint
    that says it only for its text model, in ``text_config``; None when neither does. Dtypes: ``("dtype",
    "torch_dtype")`` (transformers >= 5 writes the first, earlier ones the second)."""
    for section in (config_json, config_json.get("text_config") or {}):
        for key in keys:
            if isinstance(section.get(key), kind):
                return section[key]
    return None


def auto_model_class(path: str | os.PathLike[str], **source: Any) -> Any:
    """From the checkpoint's config.json alone: AutoModelForImageTextToText for a vision-language checkpoint (the
    whole model, its tower included, so what is saved stays servable), else AutoModelForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = is_vision_language(AutoConfig.from_pretrained(path, **source))
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def non_text_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """The names, each with a trailing dot, of a vision-language model's modules outside its text model and LM head
    (the vision tower, the projector): frozen unless model.freeze_vision_tower=false (trainer/model.py), never
    adapted by LoRA, and skipped by weight sync while frozen. () for a text-only model. ``model`` is the
    transformers model (not a peft wrapper)."""
    if not is_vision_language(getattr(model, "config", None)):
        return ()
    text = (model.get_decoder(), model.get_output_embeddings())
    found: list[str] = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if any(child is t for t in text):
                continue
            if any(inner is t for inner in child.modules() for t in text):
                walk(child, f"{prefix}{name}.")
            else:
                found.append(f"{prefix}{name}.")

    walk(model, "")
    return tuple(found)
