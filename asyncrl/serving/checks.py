"""Startup checks against the running server: everything the config needs, each failure naming its fix.

The trainer runs these once the server is healthy and before the first weight sync. A vLLM server that
disagrees fails with the exact flag to add (or, for a server asyncrl did not start, the whole command it
should be restarted with); the built-in server is checked on what it shares with vLLM (name, context
length, dev-mode endpoints, candidate sets). The result says which weight-sync backend the server speaks.
"""

from __future__ import annotations

import logging
import math
import shlex
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from asyncrl.client import ControlClient, ServerError
from asyncrl.config.schema import Config, ServerBackend, WeightTransfer
from asyncrl.flow import FlowControl
from asyncrl.serving import vllm
from asyncrl.serving.command import max_lora_rank, max_loras, served_model_name

if TYPE_CHECKING:
    from asyncrl.run_plan import RunPlan

log = logging.getLogger(__name__)

BUILTIN_VERSION_PREFIX = "asyncrl-builtin"
NCCL_FLAG = '--weight-transfer-config \'{"backend":"nccl"}\''


class ServerCheckError(RuntimeError):
    """The running server cannot serve this config; the message says what to change."""


@dataclass(frozen=True)
class ServerFacts:
    backend: str
    """builtin | vllm"""
    version: str
    max_model_len: int
    weight_transfer: str
    """The sync backend the server speaks: builtin, ipc or nccl."""
    candidate_sets: bool
    """Whether /inference/v1/generate returns each token's candidate set."""
    worker_extension: str = ""
    """vLLM's --worker-extension-cls (asyncrl's loads ipc weights in place: weights/vllm_extension.py)."""
    quantization: str = ""
    """vLLM's --quantization: weights it re-processes after loading, which an in-place load would not redo."""
    gpus: int = 1
    """The GPUs one server spans (tensor x pipeline x data parallel)."""


def check_server(plan: RunPlan, control: ControlClient) -> ServerFacts:
    """Run every check of the server against the run's plan."""
    config, expected = plan.config, plan.server_backend
    version = control.version()
    backend = "builtin" if version.startswith(BUILTIN_VERSION_PREFIX) else "vllm"
    fix = _Fix(plan, backend)
    if expected != backend and (config.server.launch or config.server.backend != ServerBackend.auto):
        raise ServerCheckError(f"server.backend={expected} but the server at {control.base_url} reports {version}"
                               + ("" if config.server.launch else f": set server.backend={backend}"))  # fmt: skip
    max_model_len = _check_model(config, control, fix, plan.needed_context(backend))
    _check_dev_mode(control, fix)
    if backend == "builtin":
        return ServerFacts(backend, version, max_model_len, "builtin", _candidate_sets(config, control, fix, True))
    _check_version(version, fix)
    info = control.server_info()
    transfer = _check_vllm_config(plan, info, fix)
    can_mask = vllm.parse_version(version)[:2] >= vllm.SAMPLING_MASK_SINCE
    engine = info.get("vllm_config") or {}
    parallel = engine.get("parallel_config") or {}
    gpus = math.prod(int(parallel.get(f"{kind}_parallel_size") or 1) for kind in ("tensor", "pipeline", "data"))
    return ServerFacts(
        backend,
        version,
        max_model_len,
        transfer,
        _candidate_sets(config, control, fix, can_mask),
        str(parallel.get("worker_extension_cls") or ""),
        str((engine.get("model_config") or {}).get("quantization") or ""),
        gpus,
    )


def check_servers(plan: RunPlan, controls: list[ControlClient]) -> ServerFacts:
    """``check_server`` on every replica; they must speak the same weight transfer (one round reaches them all),
    and the run's context is the shortest of theirs. CUDA IPC reaches only one server, on the trainer's GPU."""
    facts = [check_server(plan, control) for control in controls]
    first = facts[0]
    for index, other in enumerate(facts[1:], start=1):
        if (other.backend, other.weight_transfer) != (first.backend, first.weight_transfer):
            raise ServerCheckError(
                f"server replica {index} ({controls[index].base_url}) is {other.backend} with {other.weight_transfer} "
                f"weight transfer, replica 0 {first.backend} with {first.weight_transfer}: start them alike"
            )
    if len(facts) > 1 and first.weight_transfer == "ipc":
        raise ServerCheckError(
            f"{len(facts)} servers speak ipc weight transfer, which reaches one server on the trainer's GPU: restart "
            f"them with {NCCL_FLAG}"
        )
    return replace(first, max_model_len=min(f.max_model_len for f in facts))


class _Fix:
    """How to tell the user to fix the server: a flag for a server we launch, the full command otherwise."""

    def __init__(self, plan: RunPlan, backend: str) -> None:
        self.plan, self.config, self.backend = plan, plan.config, backend

    def __call__(self, problem: str, flag: str, key: str | None = None) -> ServerCheckError:
        if self.config.server.launch and key is not None:
            how = f"set {key}"
        elif self.config.server.launch:
            how = f"the server asyncrl started lacks {flag}: remove what overrides it from server.extra_args"
        elif self.backend == "vllm":
            how = f"restart it with {flag}; the command this config expects: {self.expected_command()}"
        else:
            how = f"restart it with {flag}"
        return ServerCheckError(f"{problem}: {how}")

    def expected_command(self) -> str:
        try:
            command = vllm.vllm_command(self.plan)
        except Exception as error:  # noqa: BLE001 - the hint must not hide the real problem
            return f"(cannot build it here: {error})"
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
        return env + " " + " ".join(shlex.quote(a) for a in command.argv)


def _check_model(config: Config, control: ControlClient, fix: _Fix, needed: int) -> int:
    name = served_model_name(config)
    cards = {card["id"]: card for card in control.models()}
    if name not in cards:
        names = sorted(cards)
        raise fix(f"the server serves {names}, not {name!r} (model.name_or_path)", f"--served-model-name {name}")
    served = int(cards[name]["max_model_len"])
    if served < needed:
        raise fix(
            f"the server's max_model_len {served} is below the {needed} tokens this config needs (longest prompt "
            f"+ sampling.max_completion_length={config.sampling.max_completion_length}, or server.max_model_len)",
            f"--max-model-len {needed}",
            key=f"server.max_model_len={needed}",
        )
    return served


def _check_dev_mode(control: ControlClient, fix: _Fix) -> None:
    for path, call in (("/is_paused", control.is_paused), ("/get_world_size", control.world_size)):
        try:
            call()
        except ServerError as error:
            if error.status != 404:
                raise
            raise fix(
                f"the server has no {path}: its dev-mode endpoints (pause, weight transfer) are off",
                "VLLM_SERVER_DEV_MODE=1 in its environment",
            ) from error


def _check_version(version: str, fix: _Fix) -> None:
    if vllm.parse_version(version)[:2] < vllm.MIN_VERSION:
        raise fix(f"the server runs vLLM {version}; asyncrl needs >= 0.26", "vLLM >= 0.26 (pip install -U vllm)")
    trainer = vllm.installed_vllm_version()
    if trainer is None or vllm.parse_version(trainer) != vllm.parse_version(version):
        raise ServerCheckError(
            f"the server runs vLLM {version} but the trainer has {trainer or 'no vLLM'}: the weight-transfer round "
            f"protocol changed in 0.28 and again in 0.33, so both sides need the same release: "
            f"pip install vllm=={version} here, or restart the server with vLLM {trainer}"
        )
    if vllm.parse_version(version)[:2] not in vllm.VERIFIED_RELEASES:
        verified = ", ".join(".".join(map(str, release)) for release in vllm.VERIFIED_RELEASES)
        log.warning("vLLM %s has not been run with asyncrl here (verified: %s; README, 'vLLM versions'): its "
                    "version-switched code paths follow vLLM's source only", version, verified)  # fmt: skip


def _check_vllm_config(plan: RunPlan, info: dict[str, Any], fix: _Fix) -> str:
    """Check /server_info's engine config and environment against the plan; return the weight-transfer backend."""
    config = plan.config
    engine = info.get("vllm_config") or {}
    model = engine.get("model_config") or {}
    env = info.get("vllm_env") or {}
    if model.get("logprobs_mode") != "processed_logprobs":
        raise fix(
            f"the server returns {model.get('logprobs_mode')} (raw logits before temperature and top-k/top-p)",
            "--logprobs-mode processed_logprobs",
        )
    wanted = config.sampling.num_sampler_logprobs
    if int(model.get("max_logprobs", wanted)) < wanted:
        raise fix(
            f"the server's --max-logprobs {model.get('max_logprobs')} is below sampling.num_sampler_logprobs",
            f"--max-logprobs {wanted}",
        )
    quantization = config.server.quantization
    if quantization is not None and str(model.get("quantization") or "") != quantization.lower():
        raise fix(
            f"server.quantization={quantization} but the server reports quantization "
            f"{model.get('quantization') or 'none'}",
            f"--quantization {quantization}",
        )
    transfer = (engine.get("weight_transfer_config") or {}).get("backend")
    want = config.server.weight_transfer
    if transfer is None:  # the plan's: an attached server's is server.weight_transfer, else nccl
        flag = f'--weight-transfer-config \'{{"backend":"{plan.weight_transfer}"}}\''
        raise fix("the server has no weight-transfer engine", flag)
    if want != WeightTransfer.auto and transfer != want.value:
        raise fix(
            f"server.weight_transfer={want.value} but the server was started with backend {transfer}",
            f'--weight-transfer-config \'{{"backend":"{want.value}"}}\'',
        )
    if transfer not in ("ipc", "nccl"):
        raise fix(f"weight-transfer backend {transfer} is not supported", "--weight-transfer-config with nccl or ipc")
    if transfer == "ipc" and not _truthy(env.get("VLLM_ALLOW_INSECURE_SERIALIZATION")):
        raise fix("ipc weight transfer sends pickled CUDA IPC handles", "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    if transfer == "ipc" and (ranks := plan.world_size) > 1:
        raise fix(
            f"the server takes weights over ipc, which shares one process's GPU memory, but the trainer has "
            f"{ranks} ranks (trainer.num_processes)",
            NCCL_FLAG,
        )
    if plan.runtime_lora:
        _check_lora(config, engine.get("lora_config"), env, fix, plan.flow)
    return str(transfer)


def _check_lora(config: Config, lora: dict[str, Any] | None, env: dict[str, Any], fix: _Fix, flow: FlowControl) -> None:
    problem = lora_problem(config, lora, env, "vllm", flow)
    if problem is not None:
        raise fix(*problem)


def lora_problem(
    config: Config, lora: dict[str, Any] | None, env: dict[str, Any], backend: str, flow: FlowControl
) -> tuple[str, str] | None:
    """Why a server whose /server_info reports ``lora`` (its lora_config) and ``env`` cannot serve this run's
    adapter versions, and the flag that fixes it; None when it can. The one rule: the startup checks above and
    lora.sync's choice (weights/adapter_choice.py) both ask it."""
    rank, loras = max_lora_rank(config), max_loras(config, flow)
    needed = flow.adapter_slots
    if lora is None:
        return "the server has LoRA off", f"--enable-lora --max-lora-rank {rank} --max-loras {loras}"
    if int(lora.get("max_lora_rank", 0)) < config.lora.r:
        return f"the server's max_lora_rank {lora.get('max_lora_rank')} is below lora.r={config.lora.r}", (
            f"--max-lora-rank {rank}"
        )
    if int(lora.get("max_loras", 0)) < needed:
        return (
            f"the server holds {lora.get('max_loras')} adapters; {needed} versions are alive at once "
            "(staleness.max_staleness + 2)",
            f"--max-loras {max(loras, needed)}",
        )
    if backend == "vllm" and not _truthy(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")):
        return "the server refuses runtime adapter loading", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
    return None


def _candidate_sets(config: Config, control: ControlClient, fix: _Fix, supported: bool) -> bool:
    """Probe /inference/v1/generate once when top-k/top-p/min-p are on; warn if the server cannot return sets."""
    if not vllm.truncating(config):
        return False
    if not supported:
        log.warning(
            "vLLM before 0.28 cannot return per-token candidate sets: top-k/top-p/min-p importance ratios "
            "are biased (the trainer normalises over the whole vocabulary)"
        )
        return False
    s = config.sampling
    params = {"max_tokens": 1, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}
    try:
        choice = control.generate([0], params)["choices"][0]
    except ServerError as error:
        if error.status in (403, 404, 405):
            raise fix(
                f"/inference/v1/generate answered HTTP {error.status}: it returns the candidate sets",
                "--enable-scale-out",
            ) from error
        if error.status is not None and error.status < 500:
            raise fix(
                f"/inference/v1/generate refused a top-k request ({error.message})",
                "--return-sampling-mask and VLLM_USE_V2_MODEL_RUNNER=1",
            ) from error
        raise
    if choice.get("sampling_mask") is None:
        raise fix("/inference/v1/generate returns no sampling_mask", "--return-sampling-mask")
    return True


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")
