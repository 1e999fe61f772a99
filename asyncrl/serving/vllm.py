"""The `vllm serve` command line and environment for a config, and the vLLM facts that decide them.

Everything comes from the config plus two facts of the machine, the vLLM release that will serve (flags
appear and change between releases) and the visible GPUs (split between server and trainer); both can be
passed in, so tests and `asyncrl config` print the exact command without vLLM or a GPU. With
``server.launch=false`` the same function gives the command the attached server should have been started
with, which is what the startup checks quote when the server disagrees with the config.

Access. A launched vLLM gets the run's token as its API key through the environment (``VLLM_API_KEY``, set by
``launch.launch_command``; never on the command line, in commands/server.sh or in plan.json), and asyncrl's clients
send it on every request. vLLM checks it only on paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``:
completions, generation, /v1/models and the runtime LoRA endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter,
which read any path the vLLM process can). The dev-mode routes (VLLM_SERVER_DEV_MODE=1) that the weight sync needs
stay open to whoever reaches the port: /pause, /resume, /init_weight_transfer_engine, /start_weight_update,
/update_weights (whose ipc payload vLLM unpickles, VLLM_ALLOW_INSECURE_SERIALIZATION=1), /finish_weight_update,
/collective_rpc, /server_info (it lists the VLLM_* environment), /sleep, /wake_up. So keep vLLM on loopback
(server.host, the default) or behind a firewall; /health and /metrics are open as well.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shlex
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config, ModelDtype, ModelImpl
from asyncrl.lora import adapter_modules
from asyncrl.model_kind import is_vision_language
from asyncrl.serving.command import (
    ServerCommand,
    lora_flags,
    replica_port,
    served_model_name,
)

if TYPE_CHECKING:
    from asyncrl.run_plan import RunPlan

log = logging.getLogger(__name__)

MIN_VERSION = (0, 26)
VERIFIED_RELEASES = ((0, 26), (0, 28), (0, 33))
"""Releases that have run asyncrl end to end on a GPU (README, "vLLM versions"); others get one warning."""
SAMPLING_MASK_SINCE = (0, 28)  # --return-sampling-mask
SCALE_OUT_FLAG_SINCE = (0, 30)  # --enable-scale-out gates /inference/v1/generate
MANY_API_SERVERS_SINCE = (0, 32)  # top log-probabilities stop costing throughput with 8 API servers
MANY_API_SERVERS = 8
WORKER_EXTENSION = "asyncrl.weights.vllm_extension.WeightBufferExtension"  # in-place ipc loads (not imported here)


def media_limits(images: int) -> str:
    """--limit-mm-per-prompt for a vision-language checkpoint: the most images a prompt of the run has (0 for text
    only: vLLM then skips multimodal profiling), no video."""
    return json.dumps({"image": images, "video": 0})


def parse_version(text: str) -> tuple[int, ...]:
    """(0, 26, 0) for "0.26.0", "v0.26.0+cu130" or "0.27.1.dev3"; the leading numeric fields only."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
    if match is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def installed_vllm_version() -> str | None:
    """The importable vLLM's release (package metadata, else the module's own, for unpacked copies)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        if importlib.util.find_spec("vllm") is None:
            return None
        from vllm import __version__

        return str(__version__)


def install_command() -> str:
    """How to install vLLM: asyncrl's ``vllm`` extra, pinned to the releases it was tested with (a bare
    ``vllm>=0.26`` also takes the untested ones). From a source checkout, the README's install, its path: right
    wherever the user runs."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return f"pip install -e {shlex.quote(f'{checkout}[vllm]')}"
    return "pip install 'asyncrl[vllm]'"


def target_version(config: Config, version: str | None = None) -> str:
    """The release the command is written for: ``version``, server.vllm_version, else the installed vllm."""
    version = version or config.server.vllm_version or installed_vllm_version()
    if version is None:
        raise ConfigError(
            f"server.backend=vllm but vllm is not installed here: install it ({install_command()}) or set "
            "server.vllm_version=X.Y.Z to only build the command"
        )
    if parse_version(version)[:2] < MIN_VERSION:
        raise ConfigError(f"vLLM {version} is too old: asyncrl needs vLLM >= 0.26 ({install_command()})")
    return version


def newest_verified_release() -> str:
    """The command's release on a machine without vLLM when server.vllm_version is not given."""
    major, minor = VERIFIED_RELEASES[-1]
    return f"{major}.{minor}.0"


def check_launchable(config: Config) -> None:
    """This machine can start the vLLM server asyncrl is to launch: vLLM installed, a GPU (as many as the split
    needs: the job's plan places them, plan/assemble.py::placed). Checked before anything loads, rather than found
    after the data and tokenizer, when the server fails."""
    installed = installed_vllm_version()
    if installed is None:
        raise ConfigError(
            f"server.backend=vllm but vllm is not installed here: install it ({install_command()}), or serve "
            "with the built-in server (server=builtin)"
        )
    target_version(config, installed)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "server.backend=vllm but torch sees no CUDA GPU here: run on a GPU machine, or serve with the built-in "
            "server (server=builtin)"
        )


SERVER_IMPORTS = ("torch", "transformers", "vllm")  # what each of vLLM's processes imports as it starts


def uncompiled_imports(packages: tuple[str, ...] = SERVER_IMPORTS) -> list[Path]:
    """The folders of ``packages`` that hold no bytecode while this Python writes none (``PYTHONDONTWRITEBYTECODE``,
    which container images often set, beside installers that skip compiling: uv by default, ``pip --no-compile``):
    every process that imports them then compiles their sources again as it starts, and a vLLM server starts
    several (the launcher, its API servers, the engine core). The variable, not this process's ``-B``, is what vLLM's
    processes inherit. Looked up without importing them."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return []  # the first import writes the bytecode the later ones read
    folders = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and spec.origin.endswith(".py"):
            if not Path(importlib.util.cache_from_source(spec.origin)).is_file():
                folders.append(Path(spec.origin).parent)
    return folders


def warn_uncompiled_imports(packages: tuple[str, ...] = SERVER_IMPORTS) -> None:
    """One warning, with the command that compiles them once, when vLLM's processes would compile their imports."""
    folders = uncompiled_imports(packages)
    if folders:
        log.warning(
            "vLLM's imports have no compiled bytecode here (%s) and PYTHONDONTWRITEBYTECODE is set: each of the vLLM "
            "server's processes compiles their sources again as it starts; compile them once with: %s",
            ", ".join(folder.name for folder in folders),
            shlex.join([sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, folders)]),
        )


@dataclass(frozen=True)
class CheckpointKind:
    """What the launch flags need to know of the checkpoint, read from its config.json (no weights)."""

    vision_language: bool = False
    gated_deltanet: bool = False
    """Has gated-DeltaNet (linear attention) layers: Qwen3.5/3.6, Qwen3-Next."""
    lora_modules: tuple[str, ...] = ()
    """The module names the run's LoRA adapter targets when adapters are served (vLLM's --lora-target-modules)."""

    @classmethod
    def of(cls, model_config: Any, lora_modules: tuple[str, ...] = ()) -> CheckpointKind:
        layer_types = getattr(model_config.get_text_config(), "layer_types", None) or []
        return cls(is_vision_language(model_config), "linear_attention" in layer_types, lora_modules)


def checkpoint_kind(plan: RunPlan) -> CheckpointKind:
    """model.name_or_path's kind from its config.json: a directory, the Hub cache, else (for a server asyncrl
    launches, which downloads the checkpoint anyway) the Hub. For an attached server's expected command a config
    that is not on this machine gives a plain kind rather than a network wait. The adapter's modules when the plan
    gives the server runtime LoRA."""
    from transformers import AutoConfig

    config = plan.config
    m, launch = config.model, config.server.launch
    try:
        model_config = AutoConfig.from_pretrained(
            m.name_or_path, revision=m.revision, local_files_only=not launch, trust_remote_code=m.trust_remote_code
        )
    except (OSError, ValueError) as error:
        if not launch:
            return CheckpointKind()
        raise ConfigError(
            f"model.name_or_path={m.name_or_path}: cannot read its config.json to launch vLLM "
            f"({type(error).__name__}: {error}); give a local checkpoint directory or a Hub id "
            "reachable from here"
        ) from error
    modules = tuple(adapter_modules(config, model_config)) if plan.runtime_lora else ()
    return CheckpointKind.of(model_config, modules)


def checked_dtype(config: Config, kind: CheckpointKind, dtype: str) -> str:
    """The serving dtype (the plan's, or serving/command.py's for a printed command), refused when vLLM cannot run
    it: its gated-DeltaNet kernels (ChunkGatedDeltaRuleFunction) assert 16-bit inputs, so a float32 server of such a
    model dies at startup."""
    if kind.gated_deltanet and dtype == "float32":
        raise ConfigError(
            f"server.dtype=float32: vLLM's gated-DeltaNet kernels run {config.model.name_or_path} in 16 bits only; "
            "leave server.dtype unset (bfloat16; the trainer keeps its float32 weights) or set server.dtype=bfloat16"
        )
    return dtype


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def checkpoint_flags(kind: CheckpointKind, images: int = 0) -> list[str]:
    """A vision-language checkpoint serves as many images a prompt as the run's prompts hold (``images``: the
    plan's prompt_images; none for text); a gated-DeltaNet hybrid
    prefills with vLLM's Triton kernels when flashinfer (its default GDN prefill imports it) is missing here.
    Served adapters get LoRA slots only in the modules they target: left to itself vLLM also wraps the embeddings
    and the LM head, which costs memory and, for a checkpoint with tied embeddings and a vocabulary smaller than
    its hidden size, fails its own LoRA warm-up (vLLM 0.26: ``set_lora`` copies a hidden-sized dummy into the
    vocabulary-sized LM-head slot)."""
    flags = ["--limit-mm-per-prompt", media_limits(images)] if kind.vision_language else []
    if kind.gated_deltanet and not flashinfer_importable():
        flags += ["--gdn-prefill-backend", "triton"]
    if kind.lora_modules:
        flags += ["--lora-target-modules", *kind.lora_modules]
    return flags


def truncating(config: Config) -> bool:
    """Whether the sampler draws from a candidate set smaller than the vocabulary."""
    s = config.sampling
    return s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0


OWN_GPU_SHARE = 0.9
"""--gpu-memory-utilization on GPUs the server has to itself (vLLM's default)."""
SHARED_GPU_SHARE = 0.3
"""On a GPU shared with the trainer before the trainer's footprint was measured (printed commands: a run measures it
before launching vLLM)."""
VLLM_OVERHEAD_BYTES = 2 * 2**30
"""vLLM's own activations, CUDA graphs and CUDA context beside its weights and KV cache."""
VLLM_CONTEXT_BYTES = 2**30
"""What a GPU shared with the trainer keeps beside the trainer's need and vLLM's share: vLLM refuses to start unless
its whole share is free once its engine process holds its CUDA context (about 0.5 GiB). The Gemma-3-270M run of
RESULTS.md (session 37) failed there 0.19 GiB short: the trainer's compiled step had grown into its margin."""


MEMORY_REFUSAL = "less than desired GPU memory utilization"
"""vLLM's startup error when its share is not free on the GPU (another process, the trainer, holds too much)."""


def memory_refusal_hint(cause: str, argv: list[str]) -> str:
    """What to add to the line of a vLLM that refused its share at startup: the asyncrl key that sets it, and the
    share it had; nothing for another cause."""
    if MEMORY_REFUSAL not in cause:
        return ""
    flag = "--gpu-memory-utilization"
    had = f" (it had {argv[argv.index(flag) + 1]})" if flag in argv else ""
    return f"; give vLLM less of the GPU with server.gpu_memory_utilization{had}"


def shared_gpu_share(plan: RunPlan, model_len: int, dtype: ModelDtype) -> tuple[float, str]:
    """The server's share of a GPU it shares with the trainer, and why: what the trainer's measured footprint
    (trainer/memory.py) and vLLM's own CUDA context leave, at most OWN_GPU_SHARE. The footprint is the plan's
    measured stage (a launched vLLM that waited for the warm-up), else the figure an earlier run of this shape
    recorded (asyncrl/footprint.py, under its rows' token budget beside a server of ``model_len``: a printed command,
    ranks on the server's GPU); SHARED_GPU_SHARE before any was measured. Refused before launch when the rest cannot
    hold vLLM's weights and one longest sequence's KV cache."""
    from asyncrl.footprint import GIB, cached_memory

    config = plan.config
    memory = plan.trainer_memory or cached_memory(config, plan.components.packer.rows(model_len)[1])
    if memory is None:
        return SHARED_GPU_SHARE, "the trainer's footprint is not measured yet: a run measures it before launching vLLM"
    rest = memory.gpu_bytes - memory.need_bytes - VLLM_CONTEXT_BYTES
    floor = vllm_floor_bytes(config, model_len, dtype)
    if rest < floor:
        raise ConfigError(
            f"one GPU cannot hold both: {memory.describe()} leaves {rest / GIB:.1f} GiB, and vLLM needs "
            f"{floor / GIB:.1f} (its weights, one {model_len}-token sequence's KV cache, 2 GiB of its "
            "own); lower packing.token_budget, use lora=default, or give vLLM a GPU of its own"
        )
    share = min(int(rest / memory.gpu_bytes * 100) / 100, OWN_GPU_SHARE)
    return share, f"{memory.describe()}, and {VLLM_CONTEXT_BYTES / GIB:.1f} GiB for vLLM's CUDA context"


def vllm_floor_bytes(config: Config, model_len: int, dtype: ModelDtype) -> int:
    """The least vLLM runs in: its weights in the plan's serving ``dtype``, the KV cache of one sequence of
    max_model_len tokens in every attention layer, and VLLM_OVERHEAD_BYTES."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.dtypes import torch_dtype

    m = config.model
    model_config = AutoConfig.from_pretrained(
        m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=m.trust_remote_code)
    width = torch.finfo(torch_dtype(dtype) or torch.bfloat16).bits // 8
    weights = sum(p.numel() for p in model.parameters()) * width
    text = model_config.get_text_config()
    layers = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * sum(t != "linear_attention" for t in layers) * text.num_key_value_heads * head_dim * width
    return int(weights + per_token * model_len + VLLM_OVERHEAD_BYTES)


def gpu_memory_utilization(plan: RunPlan, model_len: int, dtype: ModelDtype) -> float:
    """server.gpu_memory_utilization; else 0.9 on the server's own GPUs, and on a GPU shared with the trainer (the
    plan's split) what the trainer's measured footprint leaves (logged: the choice decides whether the trainer runs
    out of memory). ``dtype``: the plan's serving dtype, which sizes vLLM's weights."""
    config, split = plan.config, plan.gpu_split
    if config.server.gpu_memory_utilization is not None:
        return config.server.gpu_memory_utilization
    if split is None or not split.shared:
        return OWN_GPU_SHARE
    share, why = shared_gpu_share(plan, model_len, dtype)
    log.info(
        "vLLM shares GPU %s with the trainer: --gpu-memory-utilization %g (%s; set server.gpu_memory_utilization to "
        "choose)",
        split.server[0],
        share,
        why,
    )
    return share


def api_server_count(plan: RunPlan, version: str) -> int | None:
    """server.api_server_count; else 1 for runtime LoRA (vLLM refuses more), 8 on vLLM >= 0.32, else vLLM's default."""
    if plan.config.server.api_server_count is not None:
        return plan.config.server.api_server_count
    if plan.runtime_lora:
        return 1
    return MANY_API_SERVERS if parse_version(version)[:2] >= MANY_API_SERVERS_SINCE else None


def vllm_command(
    plan: RunPlan,
    *,
    version: str | None = None,
    checkpoint: CheckpointKind | None = None,
    replica: int = 0,
) -> ServerCommand:
    """`python -m vllm.entrypoints.cli.main serve` (what the `vllm serve` script runs) with its environment, as the
    plan decided its serving dtype, flow, context, GPUs and weight transfer (a launched vLLM's plan is placed on GPUs
    and sized: plan/assemble.py::placed, ::sized); ``checkpoint`` defaults to what model.name_or_path's config.json
    says (checkpoint_kind). ``replica``: which of server.replicas, on its own port and GPUs."""
    config = plan.config
    sv, s = config.server, config.sampling
    version = target_version(config, version)
    release = parse_version(version)[:2]
    split, transfer, model_len = plan.gpu_split, plan.weight_transfer, plan.max_model_len
    if transfer is None or model_len is None:
        raise ValueError("a vLLM's command needs its plan placed on GPUs and sized (plan/assemble.py::placed, ::sized)")
    host, port = _listen_address(config, replica)
    kind = checkpoint_kind(plan) if checkpoint is None else checkpoint
    dtype = checked_dtype(config, kind, plan.serving_dtype)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", config.model.name_or_path,
        "--served-model-name", served_model_name(config),
        "--host", host, "--port", str(port),
        "--seed", str(config.trainer.seed),
        "--dtype", dtype,
        "--max-model-len", str(model_len),
        "--max-logprobs", str(max(sv.max_logprobs, s.num_sampler_logprobs)),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--weight-transfer-config", json.dumps({"backend": transfer}),
        "--gpu-memory-utilization", str(gpu_memory_utilization(plan, model_len, dtype)),
    ]  # fmt: skip
    if split is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(split.replica(replica))
    if sv.quantization is not None:
        argv += ["--quantization", sv.quantization]
    if sv.model_impl != ModelImpl.auto:  # vLLM's default
        argv += ["--model-impl", sv.model_impl.value]
    if transfer == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the IPC handles travel pickled over HTTP
        if sv.ipc_direct_load and sv.quantization is None:  # a quantized server loads through vLLM's engine
            argv += ["--worker-extension-cls", WORKER_EXTENSION]
    if sv.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(sv.tensor_parallel_size)]
    if sv.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(sv.data_parallel_size)]
    servers = api_server_count(plan, version)
    if servers is not None:
        argv += ["--api-server-count", str(servers)]
    if truncating(config) and release >= SAMPLING_MASK_SINCE:
        argv.append("--return-sampling-mask")
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the mask is recorded by the V2 model runner only
        if release >= SCALE_OUT_FLAG_SINCE:
            argv.append("--enable-scale-out")
    if plan.runtime_lora:
        argv += lora_flags(config, plan.flow)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    argv += checkpoint_flags(kind, plan.prompt_images)
    if config.model.revision:
        argv += ["--revision", config.model.revision]
    if config.model.trust_remote_code:
        argv.append("--trust-remote-code")
    return ServerCommand("vllm", argv + list(sv.extra_args), env)


def _listen_address(config: Config, replica: int) -> tuple[str, int]:
    if config.server.launch or not config.server.base_url:
        return config.server.host, replica_port(config, replica)
    url = httpx.URL(config.server.base_url)
    return url.host or config.server.host, url.port or config.server.port
