"""Which server a run starts: the built-in server's command (server/command.py) or vLLM's (server/vllm.py)."""

from __future__ import annotations

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config
from asyncrl.server.command import ServerCommand, builtin_command, resolve_backend


def printable_server_commands(config: Config) -> tuple[list[ServerCommand], str | None]:
    """What `asyncrl config --server-command` prints (a command per server.replicas), and a warning: on a machine
    with fewer GPUs than the vLLM run needs (a login node preparing a cluster job) the commands are built for the
    GPUs the job will have."""
    replicas = range(config.server.replicas)
    if resolve_backend(config) != "vllm":
        return [builtin_command(config, replica) for replica in replicas], None
    # server/vllm.py imports torch (model_kind.py): seconds a built-in server's command need not wait
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
        warnings.append(
            f"{len(visible)} GPU(s) visible here, {needed} needed: the command is for a machine whose "
            f"CUDA_VISIBLE_DEVICES={','.join(gpus)}"
        )
    commands = [vllm_command(config, gpus=gpus, checkpoint=kind, replica=replica) for replica in replicas]
    return commands, "; ".join(warnings) or None


def server_command(config: Config, replica: int = 0, gpus: list[str] | None = None) -> ServerCommand:
    """The command of launched server ``replica`` (its own port, and GPUs under vLLM: of ``gpus``, else those
    visible)."""
    backend = resolve_backend(config)
    if backend == "vllm":
        from asyncrl.server.vllm import vllm_command  # imports torch (model_kind.py): only for a vLLM server

        return vllm_command(config, gpus=gpus, replica=replica)
    return builtin_command(config, replica)
