"""The rules of the plan's derived decisions: the server backend, the serving dtype, whether syncs are merged
before any server answers, whether a launched server gets runtime LoRA, the GPU split, the weight transfer, the
server's context (max_model_len) and whether a launched vLLM waits for the trainer's measured memory.
plan/assemble.py asks each once and freezes the answers in the RunPlan; nothing else derives them (a process reads
its plan's, plan.json).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config, LoraSync, ModelDtype, ServerBackend, WeightTransfer
from asyncrl.run_plan import GpuSplit, RunPlan


def resolve_backend(config: Config) -> str:
    """auto -> vLLM when it is importable and a GPU is present, else the built-in server."""
    if config.server.backend != ServerBackend.auto:
        return config.server.backend.value
    if importlib.util.find_spec("vllm") is None:
        return "builtin"
    import torch  # seconds to import: `asyncrl config` and `--help` never need it

    return "vllm" if torch.cuda.is_available() else "builtin"


def serving_dtype(config: Config, backend: str) -> ModelDtype:
    """The dtype the server computes in and the trainer sends weights in: server.dtype when set; else, for a server
    on a GPU (vLLM, or the built-in server on cuda), 16 bits whatever the trainer's master weights are (float16 for a
    float16 checkpoint, else bfloat16): float32 serving halves the KV cache and the throughput, and vLLM's
    gated-DeltaNet kernels refuse it; on the CPU, model.dtype (16 bits buys a CPU nothing). ``backend``: the plan's
    (``resolve_backend``). Decided once, by the plan (RunPlan.serving_dtype)."""
    if config.server.dtype is not None:
        return config.server.dtype
    if not serves_on_gpu(config, backend):
        return config.model.dtype
    return ModelDtype.float16 if checkpoint_dtype(config) == "float16" else ModelDtype.bfloat16


def serves_on_gpu(config: Config, backend: str) -> bool:
    """vLLM always does; the built-in server with server.device=cuda, or auto on a machine with CUDA."""
    if backend == "vllm":
        return True
    if config.server.device != "auto":
        return config.server.device == "cuda"
    import torch

    return torch.cuda.is_available()


def checkpoint_dtype(config: Config) -> str | None:
    """The dtype model.name_or_path's config.json stores its weights in, read from a local directory or the Hub
    cache only (never the network): None when neither has it."""
    from asyncrl.model_kind import config_field, local_config_json

    found = local_config_json(config.model.name_or_path, config.model.revision)
    return None if found is None else config_field(found, ("dtype", "torch_dtype"), str)


def adapter_sync_by_config(config: Config, backend: str) -> bool | None:
    """False when the config alone rules adapter syncs out: lora off, lora.sync=merged, or lora.sync=auto with a
    vLLM that asyncrl launches (``backend``: the plan's), which gets no LoRA (serving/command.py's
    LAUNCHED_VLLM_MERGES) unless server.extra_args asks for it. None when the running server's LoRA limits decide
    (weights/adapter_choice.py). The plan asks once (RunPlan.adapter_sync)."""
    if not config.lora.enabled or config.lora.sync == LoraSync.merged:
        return False
    sv = config.server
    if config.lora.sync == LoraSync.auto and backend == "vllm" and sv.launch and "--enable-lora" not in sv.extra_args:
        return False
    return None


def runtime_lora(config: Config) -> bool:
    """Adapters are loaded into the server at runtime (not merged into full weights): lora.sync=adapter. Under
    ``auto`` a launched vLLM gets no LoRA (it generates slower with an adapter); auto syncs adapters only to a server
    started with --enable-lora (weights/adapter_choice.py)."""
    return config.lora.enabled and config.lora.sync == LoraSync.adapter


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES when set, else every GPU torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def server_gpus(config: Config) -> int:
    """GPUs of every launched server together: server.gpus (or tensor x data parallel size) per replica."""
    sv = config.server
    return (sv.gpus or sv.tensor_parallel_size * sv.data_parallel_size) * sv.replicas


def split_gpus(config: Config, visible: list[str]) -> GpuSplit:
    """First GPUs to the servers (replica after replica), the next ones to the trainer; a trainer with none left
    shares the first server's first."""
    sv = config.server
    n_server = server_gpus(config)
    if n_server > len(visible):
        raise ConfigError(
            f"the vLLM server needs {n_server} GPU(s) (server.gpus, or tensor x data parallel size, x "
            f"server.replicas={sv.replicas}) but {len(visible)} are visible ({','.join(visible) or 'none'}; "
            "CUDA_VISIBLE_DEVICES)"
        )
    rest = visible[n_server:]
    n_trainer = config.trainer.gpus or max(1, len(rest))
    if not rest and n_trainer == 1:
        return GpuSplit(visible[:n_server], visible[:1], sv.replicas)
    if n_trainer > len(rest):
        raise ConfigError(
            f"trainer.gpus={n_trainer} but only {len(rest)} GPU(s) are left after the server's {n_server} "
            f"(visible: {','.join(visible)}): lower trainer.gpus or server.gpus"
        )
    return GpuSplit(visible[:n_server], rest[:n_trainer], sv.replicas)


def needed_gpus(config: Config) -> int:
    """GPUs a launched vLLM run needs: the server's, plus the trainer's unless ipc puts it on the server's GPU."""
    n_server = server_gpus(config)
    return n_server if config.server.weight_transfer == WeightTransfer.ipc else n_server + (config.trainer.gpus or 1)


def weight_transfer(config: Config, backend: str, split: GpuSplit | None) -> str | None:
    """builtin for the built-in server (a weights file). For vLLM: nccl when server and trainer have their own GPUs
    (``split``: a launched vLLM's), ipc when they share one (NCCL cannot pair them); for an attached vLLM
    server.weight_transfer, else nccl, the usual setup (its own flag decides at startup). None: a launched vLLM
    not placed on GPUs yet."""
    chosen = config.server.weight_transfer
    if backend == "builtin":
        return "builtin"
    if not config.server.launch:
        return "nccl" if chosen == WeightTransfer.auto else chosen.value
    if split is None:
        return None
    if chosen == WeightTransfer.auto:
        chosen = WeightTransfer.ipc if split.shared else WeightTransfer.nccl
    if chosen == WeightTransfer.nccl and split.shared:
        raise ConfigError(
            f"server.weight_transfer=nccl but server and trainer share GPU {split.trainer[0]}: NCCL cannot pair "
            "two ranks on one device; use server.weight_transfer=ipc or give the trainer its own GPU"
        )
    if chosen == WeightTransfer.ipc and (not split.shared or len(split.server) > 1):
        raise ConfigError(
            f"server.weight_transfer=ipc needs the trainer on the server's only GPU (server GPUs "
            f"{','.join(split.server)}, trainer GPUs {','.join(split.trainer)}); use server.weight_transfer=nccl"
        )
    return chosen.value


def max_model_len(config: Config, backend: str, longest_prompt: Callable[[], int]) -> int | None:
    """The context the server holds: server.max_model_len; else for vLLM, for multi-turn rollouts (tools or
    environments), whose later turns carry the earlier ones and the tools' answers, the model's context
    (max_position_embeddings, as the built-in server takes), else the longest prompt (``longest_prompt``, measured
    only when this rule needs it) plus one turn's completion budget. None for the built-in server without
    server.max_model_len: it serves its model's whole context, which the trainer reads from the model it loads."""
    if config.server.max_model_len is not None:
        return config.server.max_model_len
    if backend != "vllm":
        return None
    context = model_context(config) if config.rollout.tools or config.rollout.environment_factory else None
    if context is not None:
        return context
    return longest_prompt() + config.sampling.max_completion_length


def model_context(config: Config) -> int | None:
    """The checkpoint's max_position_embeddings from its config.json here (a vision-language one's text model's),
    None when this machine does not have it."""
    from asyncrl.model_kind import config_field, local_config_json

    found = local_config_json(config.model.name_or_path, config.model.revision)
    return None if found is None else config_field(found, ("max_position_embeddings",), int)


def measured_split_pending(plan: RunPlan) -> bool:
    """Whether a launched vLLM must wait for the trainer's warm-up: it shares the trainer's GPU and its share is not
    set. Every run measures (an earlier run's figure is stale after a change of code or library, and a vLLM booting
    beside the warm-up would count the trainer's allocations as its own while it profiles its memory)."""
    sv = plan.config.server
    if not sv.launch or sv.gpu_memory_utilization is not None or plan.server_backend != "vllm":
        return False
    if plan.world_size > 1:  # ranks on the server's one GPU: their warm-up happens in other processes
        return False
    return plan.gpu_split is not None and plan.gpu_split.shared
