"""What every server command shares: the served name and address, the LoRA slots, and the built-in server's command
line as the plan decided it (serving/vllm.py builds vLLM's; serving/choice.py picks)."""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.config.schema import Config
from asyncrl.flow import FlowControl
from asyncrl.run_plan import RunPlan, ServerCommand

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's --max-lora-rank accepts (the built-in server takes the same)."""


def base_url(config: Config, replica: int = 0) -> str:
    """The address of one server: server.base_url, else replica ``replica`` of those asyncrl launches."""
    return (config.server.base_url or f"http://{config.server.host}:{replica_port(config, replica)}").rstrip("/")


def base_urls(config: Config) -> list[str]:
    """Every server the run uses: server.base_urls when attaching to several, else one per launched replica."""
    if config.server.base_urls is not None:
        return [url.rstrip("/") for url in config.server.base_urls]
    return [base_url(config, replica) for replica in range(config.server.replicas if config.server.launch else 1)]


def replica_port(config: Config, replica: int) -> int:
    """Launched replicas listen on consecutive ports from server.port."""
    return config.server.port + replica


def served_model_name(config: Config) -> str:
    """The name clients send as ``model``: see ``served_name``."""
    return served_name(config.model.name_or_path)


def served_name(name_or_path: str) -> str:
    """A Hub id as it is; a local directory by its name, not its absolute path (which says where the files lie,
    not what they are): a run's final model or checkpoint as ``RUN/model`` or ``RUN/step_N``."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return name_or_path
    path = path.resolve()
    if path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}/{path.name}"
    return f"{path.parent.name}/{path.name}" if path.name == "model" else path.name


def builtin_command(plan: RunPlan, replica: int = 0) -> ServerCommand:
    """The built-in server's command for replica ``replica``, as the plan decided its serving dtype, flow and
    adapter choice."""
    config = plan.config
    sv = config.server
    argv = [
        sys.executable, "-m", "asyncrl.engine",
        "--model", config.model.name_or_path,
        "--served-model-name", served_model_name(config),
        "--host", sv.host,
        "--port", str(replica_port(config, replica)),
        "--dtype", plan.serving_dtype,
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
    if plan.adapter_sync is not False:  # unless merged syncs are decided; auto: adapters here (adapter_choice.py)
        argv += lora_flags(config, plan.flow)
    return ServerCommand("builtin", argv + list(sv.extra_args), env={"OMP_NUM_THREADS": str(sv.cpu_threads)})


def lora_flags(config: Config, flow: FlowControl) -> list[str]:
    """A server's runtime LoRA slots, vLLM's flags (the built-in server takes the same); ``flow``: see max_loras."""
    return ["--enable-lora", "--max-lora-rank", str(max_lora_rank(config)), "--max-loras", str(max_loras(config, flow))]


def max_lora_rank(config: Config) -> int:
    """server.max_lora_rank, else the smallest rank vLLM accepts that holds lora.r."""
    if config.server.max_lora_rank is not None:
        return config.server.max_lora_rank
    return next(rank for rank in VLLM_LORA_RANKS if rank >= config.lora.r)


LAUNCHED_VLLM_MERGES = (
    "asyncrl launches vLLM without LoRA under lora.sync=auto, as it generates 1.33-1.39x slower per token with an "
    "adapter; lora.sync=adapter launches it with LoRA"
)


def max_loras(config: Config, flow: FlowControl) -> int:
    """server.max_loras, else the adapter versions alive at once under the plan's flow rules: max_staleness + 1 in
    use, plus the next one loaded before the oldest goes."""
    return config.server.max_loras or flow.adapter_slots
