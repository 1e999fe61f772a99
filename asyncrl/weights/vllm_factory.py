"""vLLM >= 0.28 transports: ``WeightTransferTrainerFactory.trainer_init(...)`` and ``engine.send_weights()``.

vLLM's trainer engine talks to the server through a client object; ours (``RoundClient``) sends its
/init_weight_transfer_engine and /update_weights through the checked, timed-out control client and turns
its start/finish into no-ops, because ``WeightSync`` already makes those calls around the whole round. The
engine reads the weights from a ``WeightSource`` that casts them to the serving dtype; its interface
changed in 0.33 (``metadata`` became a cached property, ``iter_full`` replaced iteration, and the engines read
the metadata in ``trainer_init``, before any round has staged weights), so the source class is built against the
installed one and declares the weights of the model ``init`` is given.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import cached_property
from typing import Any

import torch

from asyncrl.client import Control, ServerError
from asyncrl.serving.process import free_port
from asyncrl.weights.tensors import parameter_metadata, serving_bytes, serving_parameters
from asyncrl.weights.transport import Transport
from asyncrl.weights.vllm_common import ipc_buffer_bytes, ipc_json, rendezvous_address, run_watched


class RoundClient:
    """vLLM's VLLMWeightSyncClient protocol over our control client; the round's start and finish are ours."""

    def __init__(self, control: Control) -> None:
        self.control = control

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.control.init_weight_transfer(init_info)

    def start_weight_update(self) -> None:
        """WeightSync has already called /start_weight_update."""

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        payload = [ipc_json(i) for i in update_info] if isinstance(update_info, list) else ipc_json(update_info)
        self.control.update_weights(payload)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """WeightSync calls /finish_weight_update itself, with the version label."""


def serving_source(transport: Transport, dtype: torch.dtype | None, declared: torch.nn.Module) -> Any:
    """A vLLM WeightSource whose metadata declares ``declared``'s weights (names, wire dtypes, shapes: fixed for
    the run) and whose iteration yields ``transport.model`` (set per round by stage()), cast to ``dtype``."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    params = [ParamMeta(name, wire, tuple(shape)) for name, wire, shape in parameter_metadata(declared, dtype)]

    def metadata(self: Any) -> list[Any]:
        return params

    def iter_full(self: Any) -> Any:
        assert transport.model is not None, "stage() runs before the engine reads the source"
        return serving_parameters(transport.model, dtype)

    declared = inspect.getattr_static(WeightSource, "metadata")
    attrs = {
        "__init__": lambda self: None,
        "metadata": cached_property(metadata) if isinstance(declared, property) else metadata,
        "iter_full": iter_full,
        "__iter__": iter_full,
    }
    return type("ServingSource", (WeightSource,), attrs)()


class FactoryTransport(Transport):
    def __init__(self, backend: str, dtype: torch.dtype | None, timeout_s: float) -> None:
        self.backend, self.dtype, self.timeout_s = backend, dtype, timeout_s
        self.engine: Any = None

    def init(self, control: Control, model: torch.nn.Module) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        init_info = self._init_info(control)
        client, source = RoundClient(control), serving_source(self, self.dtype, model)
        self.engine = run_watched(
            f"{self.backend} trainer_init",
            lambda: WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source),
            self.timeout_s,
        )

    def _init_info(self, control: Control) -> Any:
        if self.backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            # packed: one IPC handle per 1 GiB buffer for the server to open, not one per tensor
            packs = "packed" in {field.name for field in dataclasses.fields(IPCTrainerInitInfo)}
            return IPCTrainerInitInfo(rank=0, packed=True) if packs else IPCTrainerInitInfo(rank=0)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        address = rendezvous_address(control.base_url)
        return NCCLTrainerInitInfo(
            master_address=address, master_port=free_port(address), world_size=control.world_size() + 1, rank=0
        )

    def send(self, control: Control) -> float:
        if self.backend == "ipc":
            # vLLM's packed IPC buffer defaults to 1 GiB, smaller than one embedding of an 8B model (it refuses
            # a tensor that does not fit) and larger than a small model needs; size it as the 0.26 path does.
            assert self.model is not None, "stage() runs before send()"
            self.engine.packed_buffer_size_bytes = ipc_buffer_bytes(serving_bytes(self.model, self.dtype))
        run_watched(f"{self.backend} send_weights", self.engine.send_weights, self.timeout_s)
        return 0.0

    def close(self, control: Control) -> None:
        """The server lets go of the engine's buffers before the trainer frees them (see DirectIpcTransport)."""
        try:
            control.shutdown_weight_transfer()
        except ServerError as error:
            if error.status != 404:  # the endpoint exists from vLLM 0.32
                raise
        finally:
            self.engine = None
