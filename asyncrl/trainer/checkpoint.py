"""Atomic checkpoints and resume.

A checkpoint (and the final model) is written into ``NAME.tmp`` and renamed when complete (``publish``), so
a crash never leaves a half checkpoint that resume would pick up. It holds the model (save_pretrained: with
LoRA only the adapter, which resume puts back on model.name_or_path) and tokenizer, the optimizer and
scheduler states, RNG states, ``trainer_state.json`` (step, model_version, the number of trainer ranks, ...)
and ``rollout_state.json``: the index of the first prompt not yet trained, where the worker resumes, and the
prompts past it already trained (groups finish out of order), which the resumed worker skips. The model
and optimizer are the sharded resume files (``sharded/``: torch.distributed.checkpoint's fp32 master weights and
optimizer state, resharded on load for any number of ranks) plus a consolidated copy of the model in the serving
dtype (with LoRA: the adapter) that a server or ``from_pretrained`` loads (trainer/fsdp.py).

Resuming reads nothing that can run code: ``optimizer.pt`` and ``rng_state.pt`` hold only tensors and plain
Python values (numpy's RNG state as a list) and load with ``torch.load(weights_only=True)``. ``check_checkpoint``
finds a damaged checkpoint (unreadable JSON, truncated weights, a missing file) before the server starts.

With trainer.save_only_model a checkpoint holds the consolidated model, the tokenizer and ``trainer_state.json``
(``model_only``) alone: a model directory, which ``check_checkpoint`` refuses to resume as such, not as damaged.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config.schema import Config
from asyncrl.interrupts import interrupts_deferred
from asyncrl.lora import is_adapter_dir
from asyncrl.model_kind import is_vision_language, local_config_json

CHECKPOINT_PREFIX = "step_"
STATE_KEYS = {
    "trainer_state.json": ("step", "model_version", "prompts_consumed"),
    "rollout_state.json": ("prompt_index",),
}
TORCH_STATES = ("optimizer.pt", "rng_state.pt")
SHARDED_DIR = "sharded"
"""The torch.distributed.checkpoint files (fp32 master weights and optimizer state) inside a checkpoint."""


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
    done_after_index: list[int] = field(default_factory=list)
    """Prompts past prompt_index already consumed (trained or dropped): a resume must not train them again."""


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


@interrupts_deferred()
def save_checkpoint(
    output_dir: Path,
    state: TrainerState,
    tokenizer: Any,
    scheduler: Any,
    total_limit: int | None,
    write_weights: Callable[[Path], None],
    num_processes: int,
    processor_files: dict[str, bytes] | None = None,
    *,
    model_only: bool = False,
) -> Path:
    """``write_weights(directory)`` writes the model and optimizer states (with every rank: trainer/fsdp.py);
    ``processor_files`` go beside the tokenizer (see PROCESSOR_FILES). ``model_only`` (trainer.save_only_model): no
    scheduler, RNG or rollout state, and ``trainer_state.json`` says so, for the resume checks. A stop signal waits
    until the checkpoint is published (asyncrl/interrupts.py): the interrupted run resumes from it."""
    root = checkpoints_dir(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_weights(tmp)
    tokenizer.save_pretrained(tmp)
    save_processor_files(processor_files or {}, tmp)
    if not model_only:
        _save_resume_state(tmp, state, scheduler)
    (tmp / "trainer_state.json").write_text(
        json.dumps(
            {
                "step": state.step,
                "model_version": state.model_version,
                "prompts_consumed": state.prompts_consumed,
                "num_processes": num_processes,
                "model_only": model_only,
                "extra": state.extra,
            },
            indent=2,
        )
    )
    publish(tmp, final)
    if total_limit:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _save_resume_state(directory: Path, state: TrainerState, scheduler: Any) -> None:
    """What a resume restores beside the sharded model and optimizer: the scheduler, the RNG streams and where the
    rollout worker goes on."""
    torch.save({"scheduler": scheduler.state_dict()}, directory / "optimizer.pt")
    torch.save(_rng_state(), directory / "rng_state.pt")
    rollout = {"prompt_index": state.prompt_index, "done_after_index": state.done_after_index}
    (directory / "rollout_state.json").write_text(json.dumps(rollout, indent=2))


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
"""A vision-language checkpoint's image and video processor configs: vLLM loads them even to serve text, so they
go beside every saved copy of its weights (checkpoints, the final model, exports)."""


def processor_files(source: str | os.PathLike[str], revision: str | None = None) -> dict[str, bytes]:
    """The PROCESSOR_FILES that ``source`` (a directory or a Hub id) has, by name."""
    from transformers.utils import cached_file

    found = {}
    for name in PROCESSOR_FILES:
        path = cached_file(
            str(source),
            name,
            revision=revision,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
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
    done = [
        p
        for p in root.iterdir()  # not the .tmp or .old of a save in progress
        if p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def resolve_checkpoint(spec: str, output_dir: Path) -> Path:
    """``latest`` (newest in output_dir), a run directory (its newest) or a checkpoint directory."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise ResumeError(
                f"trainer.resume_from_checkpoint=latest: no checkpoint in {checkpoints_dir(output_dir)} "
                "(point hydra.run.dir at the run to resume, or give a checkpoint path)"
            )
        return found[-1]
    path = Path(spec)
    if not path.is_dir():
        raise ResumeError(
            f"trainer.resume_from_checkpoint={spec}: no such directory (give a checkpoint "
            "directory, a run directory, or latest with hydra.run.dir=<the run>)"
        )
    if (path / "trainer_state.json").is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise ResumeError(
        f"trainer.resume_from_checkpoint={spec}: not a checkpoint (no trainer_state.json) nor a run "
        f"directory with one in {checkpoints_dir(path)}"
    )


def check_checkpoint(path: Path) -> None:
    """Before anything starts: the checkpoint's state files parse, it holds more than the model, its torch states
    are whole archives whose RNG state loads without running code, and its weights are whole safetensors files."""
    if holds_model_only(path):
        raise ResumeError(
            f"trainer.resume_from_checkpoint={path} holds the model only (saved with trainer.save_only_model=true), "
            f"no optimizer, scheduler or RNG state: start a new run from it with {new_run_from(path)}"
        )
    _read_state(path, "rollout_state.json", STATE_KEYS["rollout_state.json"])
    for name in TORCH_STATES:
        file = path / name
        if not file.is_file():
            raise _damaged(path, f"{file} is missing")
        if not zipfile.is_zipfile(file):
            raise _damaged(path, f"{file} is truncated or not a torch.save archive")
    _safe_load(path / "rng_state.pt")
    if not (path / SHARDED_DIR).is_dir():
        raise ResumeError(
            f"trainer.resume_from_checkpoint={path} has no {SHARDED_DIR}/ resume files: it was written by an asyncrl "
            "from before one trainer path for every rank count (CHANGELOG); resume it with that release, or start "
            f"a new run from its weights with {new_run_from(path)}"
        )
    if not any(path.glob("*.safetensors")):
        raise _damaged(path, f"{path} holds no model weights (*.safetensors)")
    damaged = damaged_weights(path)
    if damaged:
        raise _damaged(path, damaged)


def check_vision_tower(config: Config, path: Path) -> None:
    """A vision-language checkpoint resumes under the model.freeze_vision_tower it trained with (those from before
    the key froze the tower): turned to true, the trainer's tower as trained would differ from the server's, which
    starts from the base and would get no sync of it; turned to false, the optimizer would have no state of it."""
    extra = _read_state(path, "trainer_state.json", STATE_KEYS["trainer_state.json"]).get("extra") or {}
    trained, wanted = extra.get("freeze_vision_tower", True), config.model.freeze_vision_tower
    if trained == wanted or (local_config_json(str(path)) or {}).get("vision_config") is None:
        return
    saved = str(trained).lower()
    raise ResumeError(
        f"trainer.resume_from_checkpoint={path} trained with model.freeze_vision_tower={saved}: resume it with "
        f"model.freeze_vision_tower={saved}, or start a new run from its weights with {new_run_from(path)}"
    )


def holds_model_only(path: Path) -> bool:
    """Whether the checkpoint was saved with trainer.save_only_model (the key is absent from checkpoints written
    before it existed: those are whole)."""
    return bool(_read_state(path, "trainer_state.json", STATE_KEYS["trainer_state.json"]).get("model_only"))


def new_run_from(path: Path) -> str:
    """The override that starts a new run from a checkpoint's weights: its directory is a model directory, except
    with LoRA, whose adapter ``asyncrl export`` merges into its base first."""
    if is_adapter_dir(path):
        return f"model.name_or_path=OUT after asyncrl export {path} OUT (it holds a LoRA adapter)"
    return f"model.name_or_path={path}"


def damaged_weights(directory: Path) -> str | None:
    """What is wrong with the first safetensors file under ``directory`` whose header is cut short or does not
    cover its tensors (a copy interrupted midway), found before the server or the trainer loads it; else None."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(directory.rglob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except SafetensorError as exc:
            return f"{file} is damaged ({exc})"
    return None


def _read_state(path: Path, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    file = path / name
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise _damaged(path, f"{file} is missing") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _damaged(path, f"{file} is not valid JSON ({exc})") from exc
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise _damaged(path, f"{file} lacks {', '.join(missing)}")
    return state


def _damaged(path: Path, what: str) -> ResumeError:
    """The error for a damaged checkpoint: what is wrong, and the earlier checkpoint to resume from instead."""
    earlier = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    fix = "it cannot be resumed; start the run again in a new run directory"
    if earlier:
        fix = f"resume from an earlier one (trainer.resume_from_checkpoint={earlier[-1]})"
    return ResumeError(f"trainer.resume_from_checkpoint={path}: the checkpoint is damaged: {what}; {fix}")


def _safe_load(file: Path) -> Any:
    """``torch.load`` that never runs code from the file: one written by an older asyncrl (pickled numpy RNG
    state), or by anyone else with arbitrary objects, is refused in one line."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))  # torch names the first global it refused
        reason = found.group(1) if found else type(exc).__name__
        raise ResumeError(
            f"{file} holds Python objects that only a code-running load can restore ({reason}), which asyncrl "
            "refuses (torch.load(weights_only=True)); it was written by an older asyncrl or another tool: resume "
            "from a checkpoint written by this release"
        ) from exc


def load_checkpoint(path: Path, scheduler: Any) -> TrainerState:
    """Restore the scheduler and RNG states (the model and optimizer states come from its sharded files:
    trainer/fsdp.py::load_sharded)."""
    scheduler.load_state_dict(_safe_load(path / "optimizer.pt")["scheduler"])
    _set_rng_state(_safe_load(path / "rng_state.pt"))
    trainer = _read_state(path, "trainer_state.json", STATE_KEYS["trainer_state.json"])
    rollout = _read_state(path, "rollout_state.json", STATE_KEYS["rollout_state.json"])
    return TrainerState(
        trainer["step"],
        trainer["model_version"],
        rollout["prompt_index"],
        trainer["prompts_consumed"],
        trainer.get("extra", {}),
        rollout.get("done_after_index", []),  # absent from checkpoints written before it was recorded
    )


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


def _rng_state() -> dict[str, Any]:
    """Tensors and plain values only (numpy's key array as a list), so that it loads with weights_only=True."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    numpy_state["state"]["key"] = np.asarray(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
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
