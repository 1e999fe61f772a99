"""vLLM 0.26-0.27 transports: the static ``*WeightTransferEngine.trainer_send_weights(iterator, args)`` API.

The round's HTTP calls are ours (checked, timed out); vLLM's code moves the tensors. IPC: vLLM packs the
weights into one CUDA buffer (see ``ipc_buffer_bytes``), shares its IPC handle and hands each payload to our
callback, which POSTs /update_weights. NCCL: our /update_weights POST waits on a thread while vLLM broadcasts
packed buffers from rank 0, under a watchdog.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from asyncrl.client import Control, ServerError
from asyncrl.serving.process import free_port
from asyncrl.weights.tensors import parameter_metadata, serving_bytes, serving_parameters
from asyncrl.weights.transport import Background, Transport
from asyncrl.weights.vllm_common import fields_of, ipc_buffer_bytes, ipc_json, rendezvous_address, run_watched


class StaticIpcTransport(Transport):
    def __init__(self, dtype: torch.dtype | None, timeout_s: float) -> None:
        self.dtype, self.timeout_s = dtype, timeout_s

    def send(self, control: Control) -> float:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine

        def post(update_info: Any) -> None:
            torch.cuda.current_stream().synchronize()  # the casts must land before the server maps the memory
            control.update_weights(ipc_json(fields_of(update_info)))

        assert self.model is not None, "stage() runs before send()"
        buffer = ipc_buffer_bytes(serving_bytes(self.model, self.dtype))
        args = IPCTrainerSendWeightsArgs(send_mode=post, packed=True, packed_buffer_size_bytes=buffer)
        IPCWeightTransferEngine.trainer_send_weights(serving_parameters(self.model, self.dtype), args)
        return 0.0


class StaticNcclTransport(Transport):
    PACKED = True  # one broadcast per 1 GiB buffer instead of one per tensor; both sides agree via update_info

    def __init__(self, dtype: torch.dtype | None, timeout_s: float) -> None:
        self.dtype, self.timeout_s = dtype, timeout_s
        self.group: Any = None

    def init(self, control: Control, model: torch.nn.Module) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        world_size = control.world_size() + 1
        address = rendezvous_address(control.base_url)
        port = free_port(address)
        server_side = Background(
            "POST /init_weight_transfer_engine",
            control.init_weight_transfer,
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1,
                "world_size": world_size,
            },
        )
        trainer_info = {"master_address": address, "master_port": port, "world_size": world_size}
        self.group = run_watched(
            "NCCL rendezvous",
            lambda: NCCLWeightTransferEngine.trainer_init(trainer_info),
            self.timeout_s,
            peer=server_side,
        )
        server_side.result(self.timeout_s)

    def send(self, control: Control) -> float:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

        assert self.model is not None, "stage() runs before send()"
        model, meta = self.model, parameter_metadata(self.model, self.dtype)
        update_info = {
            "names": [name for name, _, _ in meta],
            "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in meta],
            "shapes": [shape for _, _, shape in meta],
            "packed": self.PACKED,
        }
        server_side = Background("POST /update_weights", control.update_weights, update_info)

        def broadcast() -> None:
            args = NCCLTrainerSendWeightsArgs(group=self.group, packed=self.PACKED)
            NCCLWeightTransferEngine.trainer_send_weights(serving_parameters(model, self.dtype), args)
            torch.cuda.synchronize()

        run_watched("NCCL broadcast", broadcast, self.timeout_s, peer=server_side)
        sent = time.perf_counter()
        server_side.result(self.timeout_s)
        return time.perf_counter() - sent

    def close(self, control: Control) -> None:
        self.group = None
        try:
            control.shutdown_weight_transfer()
        except ServerError as error:
            if error.status != 404:  # the endpoint exists from vLLM 0.32
                raise
