"""``lora.sync`` resolved against the running server: adapter-only sync, or merged full weights.

merged: always merged weights. adapter: adapters, and a server that cannot take them is an error naming what
to restart it with. auto: adapters when the server can load them at runtime and holds enough versions,
merged otherwise (logged). A server can when its /server_info reports a ``lora_config``: vLLM started with
``--enable-lora`` (and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), or the built-in server started with
``--enable-lora``, which asyncrl passes to the built-in server it launches unless lora.sync=merged
(serving/command.py), so auto means adapters there. asyncrl launches vLLM without LoRA under auto, because
vLLM generates 1.33-1.39x slower per token with an adapter, and the run plan decides merged syncs for it before
any server answers (plan/decide.py::adapter_sync_by_config): auto picks adapters only on a vLLM the user
started with ``--enable-lora``.
"""

from __future__ import annotations

import logging

from asyncrl.client import ControlClient, ServerError
from asyncrl.config.schema import Config, LoraSync
from asyncrl.flow import FlowControl
from asyncrl.serving.checks import ServerCheckError, lora_problem

log = logging.getLogger(__name__)


def use_adapter_sync(config: Config, control: ControlClient, backend: str, flow: FlowControl) -> bool:
    """Whether this run syncs adapters only, for a run whose config leaves it to the server
    (plan/decide.py::adapter_sync_by_config is None); lora.sync=adapter on a server that cannot is an error."""
    problem = adapter_problem(config, control, backend, flow)
    if problem is None:
        return True
    if config.lora.sync == LoraSync.adapter:
        raise ServerCheckError(f"lora.sync=adapter: {problem}")
    log.info("lora.sync=auto chose merged sync: %s", problem)
    return False


def adapter_problem(config: Config, control: ControlClient, backend: str, flow: FlowControl) -> str | None:
    """Why the server cannot serve this run's adapter versions (serving/checks.py's ``lora_problem``), or None
    when it can."""
    try:
        info = control.server_info()
    except ServerError as error:
        return f"the server has no /server_info to report its LoRA limits ({error.message})"
    lora = (info.get("vllm_config") or {}).get("lora_config")
    problem = lora_problem(config, lora, info.get("vllm_env") or {}, backend, flow)
    return None if problem is None else f"{problem[0]}: restart it with {problem[1]}"
