"""The frozen plan of one run: the validated config and what is decided from it once (plan/assemble.py builds it).

The launcher, the trainer's ranks and the rollout worker read these decisions instead of deriving them again. The
type lives here, below the trainer and the servers that read it, and plan/ (above them) decides its values. The rank
count's rule lives here too, so that a server check that holds only the config (serving/checks.py) asks the same
rule the plan froze.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.config.schema import Config, ModelDtype
from asyncrl.flow import FlowControl
from asyncrl.footprint import TrainerMemory

if TYPE_CHECKING:
    from asyncrl.components import Components


def ranks_per_node(config: Config) -> int:
    """trainer.num_processes, else trainer.gpus on a GPU machine, else 1."""
    t = config.trainer
    if t.num_processes is not None:
        return t.num_processes
    return (t.gpus or 1) if torch.cuda.is_available() else 1


def world_size(config: Config) -> int:
    """The ranks of every node."""
    return ranks_per_node(config) * config.trainer.nnodes


@dataclass(frozen=True)
class GpuSplit:
    """Where a launched vLLM's replicas and the trainer run: GPU ids as CUDA_VISIBLE_DEVICES lists them."""

    server: list[str]
    """Every server replica's GPUs, replica after replica."""
    trainer: list[str]
    replicas: int = 1

    def replica(self, index: int) -> list[str]:
        """The GPUs of server replica ``index``: its equal share of ``server``, in order."""
        each = len(self.server) // self.replicas
        return self.server[index * each : (index + 1) * each]

    @property
    def shared(self) -> bool:
        return bool(set(self.server) & set(self.trainer))


@dataclass(frozen=True)
class ServerCommand:
    """A launched server's command line and environment (no secret: the token travels in the launcher's own
    environment). Built by serving/ (choice.py::server_command) as the launcher plans, held in plan.json, run by
    serving/handle.py::LaunchedServer and written to the run's commands/server.sh."""

    backend: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunPlan:
    """What a run decided once (plan/assemble.py), written to its directory as plan.json (asyncrl/plan_file.py) for
    every process of the run to read. In two stages: what is decided before anything starts, then the measured stage
    (``trainer_memory`` and the commands of a vLLM that waited for it), added once the trainer's warm-up has measured
    (plan/assemble.py::measured). Not here, because the server decides it: the training token budget (it takes the
    max_model_len the server reports)."""

    config: Config
    flow: FlowControl
    """The staleness and flow rules both sides of the rollout queue follow."""
    ranks_per_node: int
    world_size: int
    server_backend: str
    """builtin | vllm: server.backend, with auto resolved on this machine (plan/decide.py::resolve_backend)."""
    serving_dtype: ModelDtype
    """The dtype the server computes in and weight syncs send (plan/decide.py::serving_dtype); a job's plan reads
    its checkpoint's config.json after fetching it (plan/assemble.py::fetch_checkpoint_config)."""
    runtime_lora: bool
    """A launched server gets runtime LoRA slots, vLLM its LoRA flags and one API server (plan/decide.py)."""
    adapter_sync: bool | None
    """False: every sync sends merged weights (lora off, or lora.sync=merged). None: the running server's LoRA
    limits decide (lora.sync=auto or adapter: weights/adapter_choice.py), which the plan cannot know."""
    private_weights_dir: Path | None = None
    """The weights directory this job chose for the servers it launches (server.weights_dir unset): the launcher
    creates it and removes it at exit. None where the user named one, or the plan is not a launching job's."""
    gpu_split: GpuSplit | None = None
    """A launched vLLM's GPUs and the trainer's, split on the machine that launches them (plan/assemble.py::placed).
    None for the built-in server or an attached one, or a plan that is not a job's (`asyncrl config`)."""
    weight_transfer: str | None = None
    """builtin (a weights file), nccl or ipc: what the weight syncs are to use (plan/decide.py::weight_transfer);
    None for a launched vLLM not yet placed on GPUs. An attached server's own flag has the last word at startup."""
    max_model_len: int | None = None
    """The context a vLLM is to hold (plan/decide.py::max_model_len, the prompts measured once for it): a launched
    one's --max-model-len, and the length the trainer sizes its warm-up rows to before the server answers; for the
    built-in server server.max_model_len. None for a built-in server without it (its model's context), or a plan not
    sized yet (plan/assemble.py::sized: a job's, or a printed command's)."""
    prompt_tokens: int | None = None
    """The longest training prompt in tokens (data.max_prompt_length when set), measured once by the launcher where a
    vLLM's context or an attached server's check takes it (plan/assemble.py::sized); None where nothing does."""
    prompt_images: int = 0
    """The most images one training or held-out prompt has (a vLLM's --limit-mm-per-prompt), counted where a
    launched vLLM's command takes it (plan/assemble.py::sized); 0 for text."""
    server_commands: list[ServerCommand] | None = None
    """Each launched server's command, replica after replica, as a job decided it before any starts
    (plan/assemble.py::commanded) and launched it; a restart launches them again as they are. None for an attached
    server, a plan that is not a job's, or a vLLM whose share of the trainer's GPU waits for the warm-up, until the
    measured stage (plan/assemble.py::measured) adds its commands."""
    trainer_memory: TrainerMemory | None = None
    """The measured stage: the trainer's footprint that a vLLM sharing its GPU was given the rest of
    (serving/vllm.py::shared_gpu_share), as its warm-up measured it, or, where that let vLLM boot beside the warm-up,
    as an earlier run of this shape recorded it (asyncrl/footprint.py), or the room the trainer held for a first
    warm-up that autotunes for minutes (``held``: trainer/memory.py::held_room). None before the warm-up, or where no
    server waits for it."""

    def needed_context(self, backend: str) -> int:
        """The fewest tokens a server of ``backend`` (as it reports itself) must hold for this run:
        server.max_model_len; else for vLLM the longest prompt and one turn's completion (a launched one with tools:
        the context it was given); else one completion (the built-in server serves its model's whole context)."""
        config = self.config
        if config.server.max_model_len is not None:
            return config.server.max_model_len
        if backend != "vllm":
            return config.sampling.max_completion_length + 1
        if self.prompt_tokens is not None:
            return self.prompt_tokens + config.sampling.max_completion_length
        if self.max_model_len is None:
            raise RuntimeError("the run plan is not sized (plan/assemble.py::sized): its prompts were never measured")
        return self.max_model_len

    @cached_property
    def components(self) -> Components:
        """Built once per process from the config's component groups (plan/assemble.py checks them as it plans; as
        code, they are not in plan.json): the trainer runs them, the worker gets the rewards and the estimator in its
        spec."""
        from asyncrl.components import build_components

        return build_components(self.config)
