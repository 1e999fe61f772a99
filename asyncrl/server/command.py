"""Which server to run and the command line that starts it, derived from the config alone."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config, LoraSync, ServerBackend


@dataclass(frozen=True)
class ServerCommand:
    backend: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def resolve_backend(config: Config) -> str:
    """auto -> vLLM when it is importable and a GPU is present, else the built-in server."""
    if config.server.backend != ServerBackend.auto:
        return config.server.backend.value
    if importlib.util.find_spec("vllm") is None:
        return "builtin"
    import torch

    return "vllm" if torch.cuda.is_available() else "builtin"


def base_url(config: Config) -> str:
    return (config.server.base_url or f"http://{config.server.host}:{config.server.port}").rstrip("/")


def served_model_name(config: Config) -> str:
    return config.model.name_or_path


def builtin_command(config: Config) -> ServerCommand:
    sv = config.server
    argv = [
        sys.executable, "-m", "asyncrl.server",
        "--model", config.model.name_or_path,
        "--served-model-name", served_model_name(config),
        "--host", sv.host,
        "--port", str(sv.port),
        "--dtype", sv.dtype or config.model.dtype,
        "--device", sv.device,
        "--max-num-seqs", str(sv.max_num_seqs),
        "--max-logprobs", str(sv.max_logprobs),
        "--seed", str(config.trainer.seed),
    ]  # fmt: skip
    if sv.max_model_len is not None:
        argv += ["--max-model-len", str(sv.max_model_len)]
    if sv.weights_dir is not None:  # the launcher sets it; the server loads weights and adapters from no other
        argv += ["--weights-dir", sv.weights_dir]
    if config.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if config.lora.enabled and config.lora.sync != LoraSync.merged:  # auto means adapters here (sync/choice.py)
        from asyncrl.server.vllm import max_lora_rank, max_loras

        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(config)), "--max-loras", str(max_loras(config))]
    return ServerCommand("builtin", argv + list(sv.extra_args), env={"OMP_NUM_THREADS": str(sv.cpu_threads)})


def printable_server_command(config: Config) -> tuple[ServerCommand, str | None]:
    """What `asyncrl config --server-command` prints, and a warning: on a machine with fewer GPUs than the vLLM run
    needs (a login node preparing a cluster job) the command is built for the GPUs the job will have."""
    if resolve_backend(config) != "vllm":
        return builtin_command(config), None
    from asyncrl.server.vllm import CheckpointKind, checkpoint_kind, needed_gpus, visible_gpus, vllm_command

    warnings = []
    try:
        kind = checkpoint_kind(config)
    except ConfigError as error:  # a Hub id this machine cannot reach: still print the command, and say what it lacks
        kind = CheckpointKind()
        warnings.append(f"{error}; the command lacks the flags a vision-language or gated-DeltaNet checkpoint needs")
    visible, needed = visible_gpus(), needed_gpus(config)
    gpus = visible
    if config.server.launch and len(visible) < needed:
        gpus = [str(index) for index in range(needed)]
        warnings.append(f"{len(visible)} GPU(s) visible here, {needed} needed: the command is for a machine whose "
                        f"CUDA_VISIBLE_DEVICES={','.join(gpus)}")  # fmt: skip
    return vllm_command(config, gpus=gpus, checkpoint=kind), "; ".join(warnings) or None


def server_command(config: Config) -> ServerCommand:
    backend = resolve_backend(config)
    if backend == "vllm":
        from asyncrl.server.vllm import vllm_command

        return vllm_command(config)
    return builtin_command(config)
