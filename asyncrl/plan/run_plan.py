"""The frozen plan of one run: the validated config and what is decided from it once (plan/assemble.py builds it).

The launcher, the trainer's ranks and the rollout worker read these decisions instead of deriving them again.
The rank count's rule lives here, below the trainer and the servers, so that a server check that holds only the
config (serving/checks.py) asks the same rule the plan froze.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.config.schema import Config, ModelDtype
from asyncrl.flow import FlowControl

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
class RunPlan:
    """Not here, because they are not known at plan time: the memory split (the trainer's warm-up measures it on the
    GPU), the server commands (they take that split, and their weight transfer the launching machine's GPUs) and the
    token budget (it takes the server's max_model_len)."""

    config: Config
    components: Components
    """Built once from the config's component groups; the trainer runs them, the worker gets the rewards and
    the estimator in its spec."""
    flow: FlowControl
    """The staleness and flow rules both sides of the rollout queue follow."""
    ranks_per_node: int
    world_size: int
    server_backend: str
    """builtin | vllm: server.backend, with auto resolved on this machine (serving/command.py::resolve_backend)."""
    serving_dtype: ModelDtype
    """The dtype the server computes in and weight syncs send (serving/command.py::serving_dtype); a job's plan reads
    its checkpoint's config.json after fetching it (plan/assemble.py::fetch_checkpoint_config)."""
    adapter_sync: bool | None
    """False: every sync sends merged weights (lora off, or lora.sync=merged). None: the running server's LoRA
    limits decide (lora.sync=auto or adapter: weights/adapter_choice.py), which the plan cannot know."""
    private_weights_dir: Path | None = None
    """The weights directory this job chose for the servers it launches (server.weights_dir unset): the launcher
    creates it and removes it at exit. None where the user named one, or the plan is not a launching job's."""
