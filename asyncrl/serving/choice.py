"""Which server a run starts: the built-in server's command (serving/command.py) or vLLM's (serving/vllm.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.config.errors import ConfigError
from asyncrl.serving.command import builtin_command

if TYPE_CHECKING:
    from asyncrl.run_plan import RunPlan, ServerCommand
    from asyncrl.serving.vllm import CheckpointKind


def printable_server_commands(plan: RunPlan) -> tuple[list[ServerCommand], list[str]]:
    """What `asyncrl config --server-command` prints (a command per server.replicas), and a warning. It is printed
    wherever asked, a login node preparing a cluster job included: the plan is placed on the GPUs the job will have
    and sized on the prompts here or a default (plan/assemble.py::placed_for_printing, ::sized_for_printing);
    without vLLM, the commands are for the newest verified release; a checkpoint's config.json that cannot be read
    here leaves the flags it decides out, and a warning says so.
    The serving dtype is the plan's, planned after fetching the checkpoint's config.json as a job's is
    (``plan_run(..., fetch=True)``)."""
    config = plan.config
    replicas = range(config.server.replicas)
    if plan.server_backend != "vllm":
        return [builtin_command(plan, replica) for replica in replicas], []
    # serving/vllm.py imports torch (model_kind.py): seconds a built-in server's command need not wait
    from asyncrl.hub_sources import unreachable_for
    from asyncrl.serving.vllm import installed_vllm_version, newest_verified_release, vllm_command

    warnings = []
    offline = unreachable_for(config)  # first: a Hub id that is not cached then fails at once, not after retries
    version = None
    if config.server.vllm_version is None and installed_vllm_version() is None:
        version = newest_verified_release()
        warnings.append(
            f"vllm is not installed here: the command is for vLLM {version}, the newest release asyncrl has verified "
            "(server.vllm_version=X.Y.Z to choose)"
        )
    kind = _checkpoint_kind(plan, offline, warnings)
    commands = [vllm_command(plan, version=version, checkpoint=kind, replica=replica) for replica in replicas]
    return commands, warnings


def _checkpoint_kind(plan: RunPlan, offline: str | None, warnings: list[str]) -> CheckpointKind:
    """The checkpoint's kind, or a plain one and a warning naming the flags it would have decided."""
    from asyncrl.serving.vllm import CheckpointKind, checkpoint_kind, flashinfer_importable

    config = plan.config
    try:
        return checkpoint_kind(plan)
    except ConfigError as error:
        undecided = ["--limit-mm-per-prompt (a vision-language checkpoint)"]
        if not flashinfer_importable():
            undecided.append("--gdn-prefill-backend triton (gated-DeltaNet layers)")
        if plan.runtime_lora:
            undecided.append("--lora-target-modules (the adapter's modules)")
        why = offline or first_line(error.__cause__ or error)
        warnings.append(
            f"model.name_or_path={config.model.name_or_path}: its config.json cannot be read here ({why}), so the "
            f"command lacks what the checkpoint would decide: {', '.join(undecided)}"
        )
        return CheckpointKind()


def first_line(error: BaseException) -> str:
    """An error in one line: its type and its message's first line (a warning's reason)."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def server_command(plan: RunPlan, replica: int = 0) -> ServerCommand:
    """The command of launched server ``replica`` (its own port, and under vLLM its GPUs), as the plan decided its
    backend, serving dtype, flow, GPUs and weight transfer."""
    if plan.server_backend == "vllm":
        from asyncrl.serving.vllm import vllm_command  # imports torch (model_kind.py): only for a vLLM server

        return vllm_command(plan, replica=replica)
    return builtin_command(plan, replica)
