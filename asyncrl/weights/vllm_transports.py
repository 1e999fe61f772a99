"""Which vLLM transport a run syncs through: ipc or nccl, by the installed vLLM's trainer API (the factory API
from 0.28, the static one before) and, for ipc, whether the server can load the weights in place.

A quantized server (server.quantization, or a quantization it reports) takes ipc or nccl by its GPU split as any
other, always through vLLM's engine: the trainer sends 16-bit weights and the round's weight-update session
re-quantizes them. In vLLM 0.33 the ipc and nccl engines' ``start_weight_update`` call
``initialize_layerwise_reload`` and their ``finish_weight_update`` ``finalize_layerwise_reload``
(model_loader/reload/layerwise.py), which, once a layer's weights have all arrived, runs its quantization method's
``process_weights_after_loading`` again (``_layerwise_process`` clears the flag online FP8 sets to run only once)
and copies the result into the tensors CUDA graphs hold. asyncrl's in-place loader calls ``load_weights`` outside
any session, which would copy 16-bit values into the quantized parameters."""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.config.schema import Config, ModelDtype
from asyncrl.dtypes import torch_dtype
from asyncrl.serving import vllm
from asyncrl.serving.checks import ServerFacts
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


def ipc_transport(*, config: Config, run_dir: Path, dtype: ModelDtype, facts: ServerFacts | None = None) -> Transport:
    """CUDA IPC: server and trainer share one GPU. In place through asyncrl's worker extension when the server
    runs it (server.ipc_direct_load), else vLLM's ipc engine, through the installed vLLM's trainer API. ``dtype``:
    the plan's serving dtype, which the weights are sent in."""
    sent = torch_dtype(dtype)
    if config.server.ipc_direct_load and facts is not None:
        refusal = in_place_refusal(facts)
        if refusal is None:
            return DirectIpcTransport(sent, IPC_BUFFER_LIMIT)
        log.info("ipc sync through vLLM's engine (layerwise reload): %s", refusal)
    if _uses_factory_api():
        return FactoryTransport("ipc", sent, config.server.timeout)
    return StaticIpcTransport(sent, config.server.timeout)


def in_place_refusal(facts: ServerFacts) -> str | None:
    """Why asyncrl's worker extension cannot load this server's weights in place; None when it can. Quantization
    first: no flag makes that server loadable in place."""
    if (why := requantization(facts)) is not None:
        return why
    if facts.worker_extension != vllm.WORKER_EXTENSION:
        return f"start the server with --worker-extension-cls {vllm.WORKER_EXTENSION} to load weights in place"
    if facts.gpus > 1:
        return f"the server spans {facts.gpus} GPUs and the shared weight buffer lives on one"
    return None


def requantization(facts: ServerFacts | None) -> str | None:
    """Why a quantized server's rounds go through vLLM's weight-update session (the startup log's words); None for
    a server that serves its weights as loaded."""
    if facts is None or not facts.quantization:
        return None
    return (
        f"the server quantizes its weights ({facts.quantization}) as it loads them: vLLM's weight-update session "
        "re-quantizes each layer from the 16-bit weights sent (layerwise reload), which an in-place load would skip"
    )


def nccl_transport(*, config: Config, run_dir: Path, dtype: ModelDtype, facts: ServerFacts | None = None) -> Transport:
    """An NCCL broadcast from the trainer (rank 0) to every server worker: they have their own GPUs. ``dtype``: the
    plan's serving dtype."""
    sent = torch_dtype(dtype)
    if (why := requantization(facts)) is not None:
        log.info("nccl sync through vLLM's engine: %s", why)
    if _uses_factory_api():
        return FactoryTransport("nccl", sent, config.server.timeout)
    return StaticNcclTransport(sent, config.server.timeout)
