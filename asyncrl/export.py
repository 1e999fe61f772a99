"""Standalone weights from training output: a LoRA adapter merged into its base, or a full model re-saved in a
chosen dtype, each with its tokenizer, so any server or library can load the result without peft or asyncrl. A
vision-language model is exported whole, with its image/video processor configs (vLLM loads them even for text).

SOURCE is a run directory (its final ``model/``, else its newest checkpoint), a checkpoint or a model directory.
Adapters merge in float32 and are cast once at the end, so the merged weights round only once. The result is
written into a temporary directory beside OUT and renamed, so OUT is never half written.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.dtypes import DTYPES
from asyncrl.lora import ADAPTER_CONFIG, is_adapter_dir
from asyncrl.model_kind import auto_model_class, is_vision_language
from asyncrl.safetensors_files import umask_mode
from asyncrl.trainer.checkpoint import (
    PROCESSOR_FILES,
    checkpoints_dir,
    list_checkpoints,
    processor_files,
    save_processor_files,
)

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer_config.json", "tokenizer.json")


class ExportError(ValueError):
    """A source that cannot be exported or an OUT that must not be written; the message names the path."""


@dataclass(frozen=True)
class Exported:
    model_dir: Path
    """The directory the weights were read from (SOURCE itself, its ``model/`` or its newest checkpoint)."""
    out: Path
    base: str | None
    """The base model the adapter was merged into; None for a full model."""
    dtype: str
    num_parameters: int


def is_model_dir(path: Path) -> bool:
    """An adapter, or a config with full weights (single-process save_pretrained or the consolidated file)."""
    return is_adapter_dir(path) or ((path / "config.json").is_file() and any((path / w).is_file() for w in _WEIGHTS))


def resolve_source(source: Path) -> Path:
    """A model or checkpoint directory as is; a run directory's final ``model/``, else its newest checkpoint."""
    if not source.is_dir():
        raise ExportError(f"{source}: no such directory")
    if is_model_dir(source):
        return source
    if is_model_dir(source / "model"):
        return source / "model"
    checkpoints = list_checkpoints(source)
    if checkpoints and is_model_dir(checkpoints[-1]):
        return checkpoints[-1]
    if checkpoints:
        raise ExportError(
            f"{checkpoints[-1]}: checkpoint without a model (no {ADAPTER_CONFIG}, "
            f"no config.json with {' or '.join(_WEIGHTS)})"
        )
    raise ExportError(
        f"{source}: no model to export: no {ADAPTER_CONFIG}, no config.json with {_WEIGHTS[0]}, no model/ "
        f"and no {checkpoints_dir(source).name}/step_* inside"
    )


def adapter_base(model_dir: Path, base: str | None) -> str:
    """``--base`` when given, else the base the adapter was trained on."""
    if base:
        return base
    saved = json.loads((model_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not saved:
        raise ExportError(f"{model_dir / ADAPTER_CONFIG}: no base_model_name_or_path; give the base with --base")
    return str(saved)


def load_merged(model_dir: Path, base: str | None) -> tuple[Any, str | None]:
    """The model in float32, with the adapter merged into its base when ``model_dir`` holds one; a vision-language
    model whole (its vision tower as trained: untouched unless model.freeze_vision_tower=false trained it)."""
    if not is_adapter_dir(model_dir):
        return auto_model_class(model_dir).from_pretrained(model_dir, dtype=torch.float32), None
    from peft import PeftModel

    base_path = adapter_base(model_dir, base)
    try:
        base_model = auto_model_class(base_path).from_pretrained(base_path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{model_dir}: base model {base_path!r} not found ({type(exc).__name__}: {exc}); "
            "give it with --base PATH_OR_HUB_ID"
        ) from exc
    return PeftModel.from_pretrained(base_model, model_dir).merge_and_unload(), base_path


def source_tokenizer(model_dir: Path, base: str | None) -> Any:
    """The tokenizer saved with the weights, else the base's: a model without one cannot be served."""
    from transformers import AutoTokenizer

    if any((model_dir / name).is_file() for name in _TOKENIZER):
        return AutoTokenizer.from_pretrained(model_dir)
    if base is None:
        raise ExportError(f"{model_dir}: no tokenizer ({' or '.join(_TOKENIZER)})")
    try:
        return AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{model_dir}: no tokenizer ({' or '.join(_TOKENIZER)}) there or in the base {base!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def vision_files(model_dir: Path, base: str | None, model_config: Any) -> dict[str, bytes]:
    """A vision-language model's processor configs: those saved with the weights (asyncrl's checkpoints carry
    them), else the base's of a merged adapter. A warning when there are none: vLLM would not serve the result."""
    if not is_vision_language(model_config):
        return {}
    files = processor_files(model_dir) or (processor_files(base) if base is not None else {})
    if not files:
        warnings.warn(
            f"{model_dir}: a vision-language model without {' or '.join(PROCESSOR_FILES)}; copy its "
            "source checkpoint's into the export, or vLLM will not load it",
            stacklevel=2,
        )
    return files


def check_out(out: Path, model_dir: Path, overwrite: bool) -> None:
    """OUT may not hold the source, and an existing non-empty OUT is replaced only when asked."""
    resolved, source = out.resolve(), model_dir.resolve()
    if resolved == source or resolved in source.parents:
        raise ExportError(f"{out}: OUT must not be the source {model_dir} or contain it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: exists and is not empty; pass --overwrite to replace it")


def export(
    source: Path, out: Path, dtype: str = "bfloat16", base: str | None = None, overwrite: bool = False
) -> Exported:
    """Write SOURCE's model (adapter merged) in ``dtype`` with its tokenizer to OUT, atomically."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    model_dir = resolve_source(source)
    check_out(out, model_dir, overwrite)
    model, base_path = load_merged(model_dir, base)
    tokenizer = source_tokenizer(model_dir, base_path)
    model = model.to(DTYPES[dtype])
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        for weights in tmp.glob("*.safetensors"):
            umask_mode(weights)
        tokenizer.save_pretrained(tmp)
        save_processor_files(vision_files(model_dir, base_path, model.config), tmp)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    num_parameters = sum(p.numel() for p in model.parameters())
    return Exported(model_dir, out, base_path, dtype, num_parameters)


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed only after."""
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.is_dir() and any(out.iterdir()):
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
