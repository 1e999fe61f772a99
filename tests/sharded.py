"""The trainer's model as a one-process run holds it (rank 0 of a world of one, the model sharded by FSDP2), for
tests that train a step or write a checkpoint outside a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.config.schema import Config
from asyncrl.trainer import fsdp
from asyncrl.trainer.checkpoint import TrainerState, save_checkpoint
from asyncrl.trainer.model import build_optimizer
from asyncrl.trainer.ranks import Ranks


def sharded(config: Config, model: torch.nn.Module) -> tuple[torch.nn.Module, Any, Any]:
    """``model`` sharded in place (a process group must be up: the ``one_rank`` fixture), its optimizer and
    scheduler."""
    model = fsdp.shard(model, config, None)
    optimizer, scheduler = build_optimizer(config, model)
    return model, optimizer, scheduler


def save(
    output_dir: Path,
    state: TrainerState,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: Any,
    scheduler: Any,
    ranks: Ranks,
    limit: int | None = None,
    processor_files: dict[str, bytes] | None = None,
    model_only: bool = False,
) -> Path:
    """A checkpoint of the sharded ``model`` as the Trainer writes it (``model_only``: with trainer.save_only_model)."""

    def write(directory: Path) -> None:
        fsdp.save_weights(directory, model, optimizer, ranks, None, resumable=not model_only)

    return save_checkpoint(output_dir, state, tokenizer, scheduler, limit, write, ranks.world, processor_files,
                           model_only=model_only)  # fmt: skip
