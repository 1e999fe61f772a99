"""Atomic checkpoints and resume.

A checkpoint (and the final model) is written into ``NAME.tmp`` and renamed when complete (``publish``), so
a crash never leaves a half checkpoint that resume would pick up. It holds the model (save_pretrained: with
LoRA only the adapter, which resume puts back on model.name_or_path) and tokenizer, the optimizer and
scheduler states, RNG states, ``trainer_state.json`` (step, model_version, the number of trainer ranks, ...)
and ``rollout_state.json``: the index of the first prompt not yet trained, where the worker resumes. A
multi-rank (FSDP2) checkpoint holds instead of the model and optimizer states the sharded resume files
(``sharded/``, fp32 master weights and optimizer state) plus a consolidated ``model.safetensors`` in the
serving dtype (trainer/fsdp.py); it resumes only on as many ranks as wrote it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config.schema import Config
from asyncrl.model_kind import is_vision_language

CHECKPOINT_PREFIX = "step_"


class ResumeError(ValueError):
    """A checkpoint that this run cannot resume; the message says why and how."""


@dataclass
class TrainerState:
    step: int
    model_version: int
    prompt_index: int
    """First prompt (global stream index) not yet trained."""
    prompts_consumed: int
    extra: dict[str, Any]


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def save_checkpoint(
    output_dir: Path, state: TrainerState, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any,
    total_limit: int | None, write_weights: Callable[[Path], None] | None = None, num_processes: int = 1,
    processor_files: dict[str, bytes] | None = None,
) -> Path:  # fmt: skip
    """``write_weights(directory)``, when given, writes the model and optimizer states (the sharded ranks);
    ``processor_files`` go beside the tokenizer (see PROCESSOR_FILES)."""
    root = checkpoints_dir(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    states = {"scheduler": scheduler.state_dict()}
    if write_weights is None:
        model.save_pretrained(tmp)
        states["optimizer"] = optimizer.state_dict()
    else:
        write_weights(tmp)
    tokenizer.save_pretrained(tmp)
    save_processor_files(processor_files or {}, tmp)
    torch.save(states, tmp / "optimizer.pt")
    torch.save(_rng_state(), tmp / "rng_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(
        {"step": state.step, "model_version": state.model_version, "prompts_consumed": state.prompts_consumed,
         "num_processes": num_processes, "extra": state.extra}, indent=2))  # fmt: skip
    (tmp / "rollout_state.json").write_text(json.dumps({"prompt_index": state.prompt_index}, indent=2))
    publish(tmp, final)
    if total_limit:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
"""A vision-language checkpoint's image and video processor configs: vLLM loads them even to serve text, so they
go beside every saved copy of its weights (checkpoints, the final model, exports)."""


def processor_files(source: str | os.PathLike[str], revision: str | None = None) -> dict[str, bytes]:
    """The PROCESSOR_FILES that ``source`` (a directory or a Hub id) has, by name."""
    from transformers.utils import cached_file

    found = {}
    for name in PROCESSOR_FILES:
        path = cached_file(str(source), name, revision=revision, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)  # fmt: skip
        if path is not None:
            found[name] = Path(path).read_bytes()
    return found


def source_processor_files(config: Config, model_config: Any) -> dict[str, bytes]:
    """model.name_or_path's processor files when it is a vision-language checkpoint, read once at the start (the
    trainer's checkpoints and final model carry them); {} otherwise."""
    m = config.model
    return processor_files(m.name_or_path, m.revision) if is_vision_language(model_config) else {}


def save_processor_files(files: dict[str, bytes], directory: Path) -> None:
    for name, content in files.items():
        (directory / name).write_bytes(content)


def publish(tmp: Path, final: Path) -> None:
    """Give a fully written directory its final name. One already there is renamed aside first and deleted
    after, so a crash leaves the old or the new directory under the name, never a half-deleted one."""
    _fsync_dir(tmp)
    replaced = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def list_checkpoints(output_dir: Path) -> list[Path]:
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir()  # not the .tmp or .old of a save in progress
            if p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX) :].isdigit()]  # fmt: skip
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def resolve_checkpoint(spec: str, output_dir: Path) -> Path:
    """``latest`` (newest in output_dir), a run directory (its newest) or a checkpoint directory."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(
                f"trainer.resume_from_checkpoint=latest: no checkpoint in {checkpoints_dir(output_dir)} "
                "(point hydra.run.dir at the run to resume, or give a checkpoint path)"
            )
        return found[-1]
    path = Path(spec)
    if (path / "trainer_state.json").is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise FileNotFoundError(f"trainer.resume_from_checkpoint={spec}: not a checkpoint or a run directory with one")


def load_checkpoint(path: Path, optimizer: Any, scheduler: Any) -> TrainerState:
    """Restore optimizer, scheduler and RNG states (the model is loaded from ``path`` by the caller)."""
    states = torch.load(path / "optimizer.pt", weights_only=False)
    if "optimizer" in states:  # a multi-rank checkpoint's optimizer state is in its sharded files
        optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    _set_rng_state(torch.load(path / "rng_state.pt", weights_only=False))
    trainer = json.loads((path / "trainer_state.json").read_text())
    rollout = json.loads((path / "rollout_state.json").read_text())
    return TrainerState(trainer["step"], trainer["model_version"], rollout["prompt_index"],
                        trainer["prompts_consumed"], trainer.get("extra", {}))  # fmt: skip


def check_no_later_checkpoints(path: Path, output_dir: Path) -> None:
    """Refuse to resume from an earlier step than checkpoints already in the output directory: the two histories
    would mix (pruning keeps the highest steps, so it would delete the new checkpoints first, and ``latest``
    would pick the abandoned ones)."""
    step = json.loads((path / "trainer_state.json").read_text())["step"]
    later = [p.name for p in list_checkpoints(output_dir) if checkpoint_step(p) > step]
    if later:
        raise ResumeError(
            f"trainer.resume_from_checkpoint={path} is at step {step} but {checkpoints_dir(output_dir)} already "
            f"holds later checkpoints ({', '.join(later)}) from the run being replaced: move them out of that "
            "directory, or resume into a new run directory (hydra.run.dir / trainer.output_dir)"
        )


def check_world_size(path: Path, num_processes: int) -> None:
    """Refuse to resume on another number of trainer ranks than wrote the checkpoint."""
    saved = json.loads((path / "trainer_state.json").read_text()).get("num_processes", 1)
    if saved != num_processes:
        raise ResumeError(
            f"trainer.resume_from_checkpoint={path} was written by {saved} trainer rank(s) but this run has "
            f"{num_processes} (trainer.num_processes): resume with trainer.num_processes={saved}"
        )


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
