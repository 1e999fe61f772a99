"""``ipc`` sync through asyncrl's vLLM worker extension: one shared buffer, weights loaded in place.

The first round allocates a buffer on the trainer's GPU sized for the model (or for its largest chunk, past
IPC_BUFFER_LIMIT) and shares its CUDA IPC handle with the server once (weights/vllm_extension.py). Each round
copies the parameters into it in ``stage``, before the server pauses, so the pause covers one
``/collective_rpc`` per chunk, in which the server's ``load_weights`` copies from the buffer into its
parameters. No vLLM weight-update session is opened: vLLM's would re-materialise every layer (layerwise
reload), which is what this path avoids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from asyncrl.client import Control
from asyncrl.weights import weight_buffer
from asyncrl.weights.tensors import parameter_device, parameter_metadata, serving_parameters
from asyncrl.weights.transport import Transport, WeightSyncError
from asyncrl.weights.vllm_extension import LOAD, MAP, UNMAP, encode_handle


class DirectIpcTransport(Transport):
    session = False

    def __init__(self, dtype: torch.dtype | None, limit: int) -> None:
        self.dtype, self.limit = dtype, limit
        self.chunks: list[list[weight_buffer.Slot]] = []
        self.buffer: torch.Tensor | None = None
        self.mapped = False
        self._pending: Iterator[tuple[str, torch.Tensor]] | None = None

    def init(self, control: Control, model: torch.nn.Module) -> None:
        """Release a buffer that an earlier trainer left mapped on the server (one that crashed, or a run resumed
        against the same server), so its memory is not held until this trainer's first round; this trainer's
        buffer is sized from the model in ``stage``."""
        control.collective_rpc(UNMAP)

    def stage(self, model: torch.nn.Module) -> None:
        super().stage(model)
        if self.buffer is None:
            self.chunks = weight_buffer.plan_chunks(parameter_metadata(model, self.dtype), self.limit)
            size = max(weight_buffer.chunk_bytes(chunk) for chunk in self.chunks)
            self.buffer = torch.empty(size, dtype=torch.uint8, device=parameter_device(model))
        self._pending = serving_parameters(model, None)  # copy_ casts into the wire dtype without a temporary
        self._fill(self.chunks[0])

    def send(self, control: Control) -> float:
        assert self.buffer is not None, "stage() runs before send()"
        if not self.mapped:
            control.collective_rpc(MAP, handle=self.share(self.buffer))
            self.mapped = True
        for index, chunk in enumerate(self.chunks):
            if index > 0:
                self._fill(chunk)
            control.collective_rpc(LOAD, layout=weight_buffer.encode(chunk))
        return 0.0

    def share(self, buffer: torch.Tensor) -> str:
        """The string the server opens the buffer from (a CUDA IPC handle)."""
        return encode_handle(buffer)

    def _fill(self, chunk: Sequence[weight_buffer.Slot]) -> None:
        assert self.buffer is not None and self._pending is not None
        with torch.no_grad():
            for slot_name, view in weight_buffer.views(self.buffer, chunk):
                name, tensor = next(self._pending, (None, None))
                if name != slot_name or tensor is None:
                    raise WeightSyncError(
                        f"the model's parameters no longer match the shared weight buffer "
                        f"({name} where {slot_name} was laid out)"
                    )
                view.copy_(tensor)
        if chunk is self.chunks[-1] and (extra := next(self._pending, None)) is not None:
            raise WeightSyncError(
                f"the model's parameters no longer match the shared weight buffer ({extra[0]} was not laid out)"
            )
        if self.buffer.is_cuda:
            torch.cuda.current_stream().synchronize()  # the server reads the buffer from another process

    def discard(self) -> None:
        self._pending = None
        super().discard()

    def close(self, control: Control) -> None:
        """The server unmaps before the buffer is dropped: a CUDA IPC allocation freed while another process
        still maps it is what makes torch warn at exit (benchmarks/ipc_release.py measured each order)."""
        try:
            if self.mapped:
                control.collective_rpc(UNMAP)
        finally:
            self.buffer, self.mapped = None, False
