"""``lora.sync`` resolved against the running server: adapter-only sync, or merged full weights.

merged: always merged weights. adapter: adapters, and a server that cannot take them is an error naming what
to restart it with. auto: adapters when the server can load them at runtime and holds enough versions,
merged otherwise (logged). A server can when its /server_info reports a ``lora_config``: vLLM started with
``--enable-lora`` (and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), or the built-in server started with
``--enable-lora``, which asyncrl passes to the built-in server it launches unless lora.sync=merged
(server/command.py), so auto means adapters there. asyncrl launches vLLM without LoRA under auto, because
vLLM generates 1.33-1.39x slower per token with an adapter: auto picks adapters only on a vLLM the user
started with ``--enable-lora``.
"""

from __future__ import annotations

import logging

from asyncrl.client import ControlClient, ServerError
from asyncrl.config.schema import Config, LoraSync
from asyncrl.flow import FlowControl
from asyncrl.server import vllm
from asyncrl.server.checks import ServerCheckError

log = logging.getLogger(__name__)


def use_adapter_sync(config: Config, control: ControlClient, backend: str) -> bool:
    """Whether this run syncs adapters only; lora.sync=adapter on a server that cannot is an error."""
    if not config.lora.enabled or config.lora.sync == LoraSync.merged:
        return False
    problem = adapter_problem(config, control, backend)
    if problem is None:
        return True
    if config.lora.sync == LoraSync.adapter:
        raise ServerCheckError(f"lora.sync=adapter: {problem}")
    log.info("lora.sync=auto chose merged sync: %s", problem)
    return False


def adapter_problem(config: Config, control: ControlClient, backend: str) -> str | None:
    """Why the server cannot serve this run's adapter versions, or None when it can."""
    rank, loras = vllm.max_lora_rank(config), vllm.max_loras(config)
    try:
        info = control.server_info()
    except ServerError as error:
        return f"the server has no /server_info to report its LoRA limits ({error.message})"
    lora = (info.get("vllm_config") or {}).get("lora_config")
    if lora is None:
        return f"the server has LoRA off: restart it with --enable-lora --max-lora-rank {rank} --max-loras {loras}"
    env = info.get("vllm_env") or {}
    if backend == "vllm" and str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() not in ("1", "true"):
        return "the server refuses runtime adapter loading: restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
    if int(lora.get("max_lora_rank", 0)) < config.lora.r:
        return (
            f"the server's max_lora_rank {lora.get('max_lora_rank')} is below lora.r={config.lora.r}: "
            f"restart it with --max-lora-rank {rank}"
        )
    needed = FlowControl.from_config(config).adapter_slots
    if int(lora.get("max_loras", 0)) < needed:
        return (
            f"the server holds {lora.get('max_loras')} adapters and max_staleness + 2 versions are alive at "
            f"once: restart it with --max-loras {max(loras, needed)}"
        )
    return None
