"""The trainer's GPU footprint as its warm-up measured it (trainer/memory.py), with the margin a server sharing its GPU
must leave it. The figure is kept per shape in a small cache (``$ASYNCRL_CACHE_DIR``, else ``~/.cache/asyncrl``,
``trainer_memory.json``), which the trainer writes and reads (the next run of a shape launches vLLM on it at once),
as does a vLLM command without a figure of its own run (serving/vllm.py: a printed one, ranks on the server's GPU):
below both. A run's own figure is its plan's measured stage (asyncrl/run_plan.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from asyncrl.config.schema import Config

log = logging.getLogger(__name__)

GIB = 2**30
MARGIN_FRACTION = 0.3
"""Headroom over the measured peak, for what the eager warm-up does not show: the compiled step's own buffers,
evaluation, checkpoint gathers, sync buffers, allocator fragmentation, and what vLLM takes beyond its
--gpu-memory-utilization once it runs (its CUDA graphs; the CUDA context it holds at startup is set aside apart,
serving/vllm.py's VLLM_CONTEXT_BYTES). At 0.1 the 2B quick start ran out of memory at step 2: the
trainer held 28.8 GiB against a 26.0 GiB warm-up peak, vLLM 1.9 GiB over its share (RESULTS.md, session 17).
At least MARGIN_MIN_BYTES."""
MARGIN_MIN_BYTES = 2 * GIB
CACHE_FILE = "trainer_memory.json"


@dataclass(frozen=True)
class TrainerMemory:
    """What the warm-up measured on one GPU."""

    peak_bytes: int
    """The warm-up step's peak in the caching allocator (max_memory_reserved)."""
    context_bytes: int
    """The rest of the process's footprint: CUDA context, cuBLAS and NCCL workspaces (outside the allocator)."""
    gpu_bytes: int
    held: bool = False
    """Not a measurement: the room the trainer held before its warm-up for a vLLM launched beside it
    (trainer/memory.py::held_room), its need all of that room."""

    @classmethod
    def with_need(cls, need_bytes: int, context_bytes: int, gpu_bytes: int) -> TrainerMemory:
        """The held room whose ``need_bytes`` is ``need_bytes``: the footprint that, with its margin, comes to it."""
        footprint = min(int(need_bytes / (1 + MARGIN_FRACTION)), need_bytes - MARGIN_MIN_BYTES)
        return cls(footprint - context_bytes, context_bytes, gpu_bytes, held=True)

    @property
    def footprint_bytes(self) -> int:
        return self.peak_bytes + self.context_bytes

    @property
    def need_bytes(self) -> int:
        """The footprint with the margin: what vLLM must leave the trainer."""
        return self.footprint_bytes + max(int(self.footprint_bytes * MARGIN_FRACTION), MARGIN_MIN_BYTES)

    def describe(self) -> str:
        if self.held:
            return (
                f"the trainer's room held before its warm-up, {self.need_bytes / GIB:.1f} of the GPU's "
                f"{self.gpu_bytes / GIB:.1f} GiB ({self.context_bytes / GIB:.1f} GiB of it outside its allocator)"
            )
        return (
            f"the trainer's measured peak {self.peak_bytes / GIB:.1f} GiB + {self.context_bytes / GIB:.1f} GiB CUDA "
            f"context + margin = {self.need_bytes / GIB:.1f} of the GPU's {self.gpu_bytes / GIB:.1f} GiB"
        )


def cache_dir() -> Path:
    return Path(os.environ.get("ASYNCRL_CACHE_DIR") or Path.home() / ".cache" / "asyncrl")


def shape_key(config: Config, token_budget: int) -> str:
    """What decides the trainer's footprint (model, precision, LoRA, checkpointing, attention, compile, the optimizer
    and its arguments (amsgrad, SGD's momentum: more state), row size, top log-probabilities, reward models, torch
    and the GPU), hashed: runs that differ only elsewhere share a figure."""
    from asyncrl.rewards.reward_model import reward_model_options

    t = config.trainer
    parts = {
        "model": OmegaConf.to_container(OmegaConf.structured(config.model)),
        "lora": OmegaConf.to_container(OmegaConf.structured(config.lora)),
        "trainer": [t.gradient_checkpointing, t.logit_chunk_tokens, t.attention, t.compile_layers, t.bf16],
        "precision_optimizer": [t.fp16, t.optim, t.optim_args, t.gradient_checkpointing_kwargs],
        "packing": config.packing,
        "loss": config.loss,
        "top_k": config.sampling.num_sampler_logprobs,
        "token_budget": token_budget,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if t.optimizer_factory is not None:  # its own optimizer's state: a figure of its own
        parts["optimizer_factory"] = t.optimizer_factory
    reward_models = reward_model_options(config)
    if reward_models:  # loaded on the trainer's GPU before the warm-up (rewards/endpoint.py): part of the footprint
        parts["reward_models"] = [(options.path, options.dtype) for _, options in reward_models]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_memory(config: Config, token_budget: int) -> TrainerMemory | None:
    """The figure a warm-up of this shape recorded, if any."""
    path = cache_dir() / CACHE_FILE
    try:
        entry = json.loads(path.read_text())[shape_key(config, token_budget)]
        return TrainerMemory(**entry)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_memory(config: Config, token_budget: int, memory: TrainerMemory) -> None:
    """Keep the figure for the next run of this shape (written beside and renamed: readers never see half)."""
    path = cache_dir() / CACHE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = json.loads(path.read_text()) if path.is_file() else {}
        entries[shape_key(config, token_budget)] = asdict(memory)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1))
        partial.replace(path)
    except (OSError, ValueError) as error:
        log.warning("could not record the trainer's memory in %s (%s): the next run measures again", path, error)
