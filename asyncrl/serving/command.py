"""What every server command shares, derived from the config alone: the backend, the served name and address,
the LoRA slots, and the built-in server's command line (serving/vllm.py builds vLLM's; serving/choice.py picks)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config.schema import Config, LoraSync, ModelDtype, ServerBackend
from asyncrl.flow import FlowControl

if TYPE_CHECKING:
    from asyncrl.plan.run_plan import RunPlan

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's --max-lora-rank accepts (the built-in server takes the same)."""


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
    import torch  # seconds to import: `asyncrl config` and `--help` never need it

    return "vllm" if torch.cuda.is_available() else "builtin"


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


def serving_dtype(config: Config, backend: str | None = None) -> ModelDtype:
    """The dtype the server computes in and the trainer sends weights in: server.dtype when set; else, for a server
    on a GPU (vLLM, or the built-in server on cuda), 16 bits whatever the trainer's master weights are (float16 for a
    float16 checkpoint, else bfloat16): float32 serving halves the KV cache and the throughput, and vLLM's
    gated-DeltaNet kernels refuse it; on the CPU, model.dtype (16 bits buys a CPU nothing). ``backend``: the plan's
    (``resolve_backend`` when not given). A run reads its plan's (plan/assemble.py decides it once)."""
    if config.server.dtype is not None:
        return config.server.dtype
    if not serves_on_gpu(config, backend):
        return config.model.dtype
    return ModelDtype.float16 if checkpoint_dtype(config) == "float16" else ModelDtype.bfloat16


def serves_on_gpu(config: Config, backend: str | None = None) -> bool:
    """vLLM always does; the built-in server with server.device=cuda, or auto on a machine with CUDA."""
    if (backend or resolve_backend(config)) == "vllm":
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


def builtin_command(config: Config, replica: int = 0, *, plan: RunPlan | None = None) -> ServerCommand:
    """The built-in server's command for replica ``replica``; ``plan``: the run's, whose serving dtype, flow and
    adapter choice it takes (None, for a printed command or a test: decided from the config here)."""
    sv = config.server
    dtype = plan.serving_dtype if plan is not None else serving_dtype(config)
    argv = [
        sys.executable, "-m", "asyncrl.engine",
        "--model", config.model.name_or_path,
        "--served-model-name", served_model_name(config),
        "--host", sv.host,
        "--port", str(replica_port(config, replica)),
        "--dtype", dtype,
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
    if loads_adapters(config, plan):  # auto: adapters here (weights/adapter_choice.py)
        argv += lora_flags(config, plan.flow if plan is not None else None)
    return ServerCommand("builtin", argv + list(sv.extra_args), env={"OMP_NUM_THREADS": str(sv.cpu_threads)})


def lora_flags(config: Config, flow: FlowControl | None) -> list[str]:
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


def adapter_sync_by_config(config: Config, backend: str | None) -> bool | None:
    """False when the config alone rules adapter syncs out: lora off, lora.sync=merged, or lora.sync=auto with a
    vLLM that asyncrl launches (``backend``: the plan's), which gets no LoRA (LAUNCHED_VLLM_MERGES) unless
    server.extra_args asks for it. None when the running server's LoRA limits decide (weights/adapter_choice.py).
    The plan asks once (RunPlan.adapter_sync)."""
    if not config.lora.enabled or config.lora.sync == LoraSync.merged:
        return False
    sv = config.server
    if config.lora.sync == LoraSync.auto and backend == "vllm" and sv.launch and "--enable-lora" not in sv.extra_args:
        return False
    return None


def loads_adapters(config: Config, plan: RunPlan | None) -> bool:
    """Whether the built-in server gets LoRA slots: unless merged syncs are decided (RunPlan.adapter_sync)."""
    decided = plan.adapter_sync if plan is not None else adapter_sync_by_config(config, "builtin")
    return decided is not False


def max_loras(config: Config, flow: FlowControl | None = None) -> int:
    """Adapter versions alive at once: max_staleness + 1 in use, plus the next one loaded before the oldest goes.
    ``flow``: the plan's (the config's when not given: a printed command, a test)."""
    return config.server.max_loras or (flow or FlowControl.from_config(config)).adapter_slots
