"""LoRA adapters with peft: the config's ``lora`` group as a peft LoraConfig, the wrapped model, its merged
weights under the base model's parameter names (what a server without adapter support loads), and its adapter
files.

The trainer's model is sharded (trainer/fsdp.py), so merging and saving read whole tensors gathered by name
(``full``) rather than the layers' own parameters: peft's ``get_delta_weight`` on a layer would compute on
shards, a collective that only rank 0 calls. The delta is peft's for LoRA's Linear and Embedding layers
(B @ A times the layer's scaling, transposed for fan-in-fan-out and embedding weights).

Below the trainer, the weight syncs (weights/) and the server launch (serving/vllm.py), which all name adapters
and merged weights alike."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.schema import Config
from asyncrl.model_kind import is_vision_language, non_text_prefixes
from asyncrl.safetensors_files import save_safetensors

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
_PEFT_ROOT = "base_model.model."
_LAYER_WRAPPERS = (".base_layer.", ".modules_to_save.default.")


def _targets(config: Config) -> str | list[str]:
    """``all-linear`` stays a string (peft expands it, never to the output layer); anything else a list."""
    targets = config.lora.target_modules
    names = [targets] if isinstance(targets, str) else [str(name) for name in targets]
    if "lm_head" in names or "lm_head" in (config.lora.modules_to_save or []):
        raise ValueError("lora.target_modules must not include lm_head: adapters on lm_head are not supported")
    return targets if isinstance(targets, str) else names


def peft_config(config: Config, exclude: Sequence[str] = ()) -> Any:
    """The ``lora`` config group as a peft LoraConfig for a causal LM; no adapter goes inside the modules named
    by the ``exclude`` prefixes (a vision-language model's vision tower and projector, trainer/model.py)."""
    from peft import LoraConfig, TaskType

    lora = config.lora
    modules_to_save = list(lora.modules_to_save) if lora.modules_to_save else None
    excluded = "|".join(re.escape(prefix) + ".*" for prefix in exclude) or None  # peft full-matches module names
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=_targets(config),
        bias=lora.bias,
        modules_to_save=modules_to_save,
        exclude_modules=excluded,
    )


def adapter_modules(config: Config, model_config: Any) -> list[str]:
    """The names (last dotted part) of the modules the adapter targets, for a server that must reserve LoRA slots
    in them: a list in lora.target_modules as given, else what peft resolves ``all-linear`` or a pattern to on a
    weightless (meta-device) copy of the model built from ``model_config``."""
    targets = _targets(config)
    if not isinstance(targets, str):
        return targets
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_language(model_config) else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(model_config)
    wrapped = get_peft_model(skeleton, peft_config(config, non_text_prefixes(skeleton)))
    return sorted({name.rpartition(".")[2] for name in wrapped.targeted_module_names})


def is_adapter_dir(path: str | Path) -> bool:
    """A directory written by a peft model's save_pretrained (an adapter checkpoint, not full weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _check_tied_embeddings(config: Config, base: torch.nn.Module) -> None:
    """Training a tied input embedding trains lm_head too, which the adapters must not touch."""
    if not getattr(base.config, "tie_word_embeddings", False):
        return
    embedding = base.get_input_embeddings()
    leaf = next(name for name, module in base.named_modules() if module is embedding).rpartition(".")[2]
    targets = config.lora.target_modules
    adapted = ([] if isinstance(targets, str) else list(targets)) + list(config.lora.modules_to_save or [])
    if leaf in adapted:
        raise ValueError(
            f"lora: {config.model.name_or_path} ties {leaf} to lm_head, so adapting {leaf} "
            "(lora.target_modules / lora.modules_to_save) would train lm_head, which is not supported"
        )


def wrap(config: Config, base: torch.nn.Module, path: str) -> torch.nn.Module:
    """The base model with trainable adapters: fresh ones, or those saved at ``path`` (a resumed checkpoint)."""
    from peft import PeftModel, get_peft_model

    if is_adapter_dir(path):
        return PeftModel.from_pretrained(base, path, is_trainable=True)
    if config.trainer.save_strategy == "no":
        warnings.warn(
            "lora with trainer.save_strategy=no: only checkpoints keep the trained adapter (the server's "
            "adapter cache is not one); an interrupted run leaves nothing",
            stacklevel=2,
        )
    _check_tied_embeddings(config, base)
    model = get_peft_model(base, peft_config(config, non_text_prefixes(base)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA r=%d alpha=%d: %d trainable parameters", config.lora.r, config.lora.alpha, trainable)
    return model


def is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_name(name: str) -> str | None:
    """The base model's name for a peft model's tensor, or None for tensors the merged model does not have
    (the adapter's own weights, and the frozen originals that ``modules_to_save`` replaced)."""
    name = name.removeprefix(_PEFT_ROOT)
    if ".lora_" in name or ".original_module." in name:
        return None
    for wrapper in _LAYER_WRAPPERS:
        name = name.replace(wrapper, ".")
    return name


def _with_delta(
    model: torch.nn.Module, name: str, tensor: torch.Tensor, full: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """A wrapped layer's base weight plus its active adapters' deltas (the layer itself stays unmerged)."""
    if not name.endswith(".base_layer.weight"):
        return tensor
    prefix = name.removesuffix(".base_layer.weight")
    layer = model.get_submodule(prefix)
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return tensor
    merged, root = tensor.detach(), f"{_PEFT_ROOT}{prefix}"
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_A", {}):
            a, b = full(f"{root}.lora_A.{adapter}.weight").float(), full(f"{root}.lora_B.{adapter}.weight").float()
            delta = (b @ a).T if layer.fan_in_fan_out else b @ a
        elif adapter in getattr(layer, "lora_embedding_A", {}):
            a, b = full(f"{root}.lora_embedding_A.{adapter}"), full(f"{root}.lora_embedding_B.{adapter}")
            delta = (b.float() @ a.float()).T
        else:
            continue
        merged = (merged.float() + delta * layer.scaling[adapter]).to(tensor.dtype)
    return merged


def merged_tensors(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], full: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(base name, merged tensor, the tensor it came from) for a peft model's ``named_parameters()`` or
    ``state_dict().items()``, whose whole parameters ``full`` returns by name; the source tensor lets callers skip
    tied storages."""
    inner = model.base_model.model
    for name, tensor in named:
        target = base_name(name)
        if target is not None:
            yield target, _with_delta(inner, name.removeprefix(_PEFT_ROOT), tensor, full), tensor


def adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names, from ``model``'s trainable ``tensors`` by parameter name."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=tensors, save_embedding_layers=False)


def save_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """peft's adapter files (what ``save_pretrained`` writes) from the trainable ``tensors`` by parameter name."""
    model.peft_config["default"].save_pretrained(str(directory))
    state = {name: t.contiguous() for name, t in adapter_state(model, tensors).items()}
    save_safetensors(state, directory / ADAPTER_FILE)
