"""Which vLLM transport a run syncs through: ipc or nccl, by the installed vLLM's trainer API (the factory API
from 0.28, the static one before) and, for ipc, whether the server can load the weights in place."""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.config.schema import Config
from asyncrl.dtypes import torch_dtype
from asyncrl.serving import vllm
from asyncrl.serving.checks import ServerFacts
from asyncrl.serving.command import serving_dtype
from asyncrl.weights.transport import Transport, WeightSyncError
from asyncrl.weights.vllm_common import IPC_BUFFER_LIMIT
from asyncrl.weights.vllm_direct import DirectIpcTransport
from asyncrl.weights.vllm_factory import FactoryTransport
from asyncrl.weights.vllm_static import StaticIpcTransport, StaticNcclTransport

log = logging.getLogger(__name__)

FACTORY_API_SINCE = (0, 28)  # WeightTransferTrainerFactory.trainer_init + engine.send_weights()


def _uses_factory_api() -> bool:
    version = vllm.installed_vllm_version()
    if version is None:
        raise WeightSyncError("vLLM weight sync needs vllm on the trainer side too (the server's release)")
    return vllm.parse_version(version)[:2] >= FACTORY_API_SINCE


def ipc_transport(*, config: Config, run_dir: Path, facts: ServerFacts | None = None) -> Transport:
    """CUDA IPC: server and trainer share one GPU. In place through asyncrl's worker extension when the server
    runs it (server.ipc_direct_load), else vLLM's ipc engine, through the installed vLLM's trainer API."""
    dtype = torch_dtype(serving_dtype(config))
    if config.server.ipc_direct_load and facts is not None:
        refusal = in_place_refusal(facts)
        if refusal is None:
            return DirectIpcTransport(dtype, IPC_BUFFER_LIMIT)
        log.info("ipc sync through vLLM's engine (layerwise reload): %s", refusal)
    if _uses_factory_api():
        return FactoryTransport("ipc", dtype, config.server.timeout)
    return StaticIpcTransport(dtype, config.server.timeout)


def in_place_refusal(facts: ServerFacts) -> str | None:
    """Why asyncrl's worker extension cannot load this server's weights in place; None when it can."""
    if facts.worker_extension != vllm.WORKER_EXTENSION:
        return f"start the server with --worker-extension-cls {vllm.WORKER_EXTENSION} to load weights in place"
    if facts.quantization:
        return (
            f"the server quantizes its weights ({facts.quantization}) after loading them, which an in-place "
            "load would not redo"
        )
    if facts.gpus > 1:
        return f"the server spans {facts.gpus} GPUs and the shared weight buffer lives on one"
    return None


def nccl_transport(*, config: Config, run_dir: Path, facts: ServerFacts | None = None) -> Transport:
    """An NCCL broadcast from the trainer (rank 0) to every server worker: they have their own GPUs."""
    dtype = torch_dtype(serving_dtype(config))
    if _uses_factory_api():
        return FactoryTransport("nccl", dtype, config.server.timeout)
    return StaticNcclTransport(dtype, config.server.timeout)
