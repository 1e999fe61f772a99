"""asyncrl's vLLM worker extension: weights loaded in place from one CUDA buffer the trainer shares once.

vLLM mixes ``WeightBufferExtension`` into its GPU worker when started with ``--worker-extension-cls
asyncrl.weights.vllm_extension.WeightBufferExtension`` (asyncrl adds it to the vLLM it launches for ``ipc``
sync); the trainer calls the methods through the dev-mode ``/collective_rpc`` (weights/vllm_direct.py).

Why not vLLM's own ``ipc`` engine: per round it allocates, shares and opens a fresh buffer, clones every tensor
out of it, and re-materialises each layer from the meta device (layerwise reload): 0.14-0.19 s for
Qwen3-0.6B on an H200. Here the buffer is opened once and every round is the model's own ``load_weights``
copying from views of it into the parameters, in place, so CUDA graphs stay valid. That is exact for
unquantized serving; a quantized server re-processes weights after loading and takes vLLM's path
(weights/vllm_transports.py::in_place_refusal).

Runs inside vLLM's worker process: torch, the standard library and weights/weight_buffer.py only.
"""

from __future__ import annotations

import base64
import os
import pickle
from typing import Any

import torch

from asyncrl.weights import weight_buffer

EXTENSION = f"{__name__}.WeightBufferExtension"
MAP, LOAD, UNMAP = "asyncrl_map_weight_buffer", "asyncrl_load_weights", "asyncrl_unmap_weight_buffer"
DEVICE_INDEX_ARG = 6  # in torch's rebuild_cuda_tensor arguments: the sender's device index, replaced by ours


def encode_handle(buffer: torch.Tensor) -> str:
    """The trainer's side: ``buffer``'s CUDA IPC handle and its GPU's UUID, as a string argument."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
    return base64.b64encode(pickle.dumps({"gpu": uuid, "args": args})).decode("ascii")


class WeightBufferExtension:
    """Methods vLLM adds to its worker. vLLM refuses an extension whose attribute names its worker already has,
    so every name here starts with ``asyncrl_``."""

    _asyncrl_buffer: torch.Tensor | None = None

    def asyncrl_map_weight_buffer(self, handle: str) -> int:
        """Open the trainer's buffer (once per run); returns its size in bytes."""
        if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "").lower() not in ("1", "true"):
            raise RuntimeError(
                "asyncrl's weight buffer handle is pickled: start vLLM with VLLM_ALLOW_INSECURE_SERIALIZATION=1"
            )
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        shared: dict[str, Any] = pickle.loads(base64.b64decode(handle))
        device = self._asyncrl_device()
        ours = str(torch.cuda.get_device_properties(device).uuid)
        if shared["gpu"] != ours:
            raise RuntimeError(
                f"the trainer's weight buffer is on GPU {shared['gpu']} but this worker runs on "
                f"{ours}: ipc sync needs trainer and server on one GPU"
            )
        args = list(shared["args"])
        args[DEVICE_INDEX_ARG] = device
        self._asyncrl_buffer = rebuild_cuda_tensor(*args)
        return int(self._asyncrl_buffer.numel())

    def asyncrl_load_weights(self, layout: str) -> None:
        """Load the tensors ``layout`` (weight_buffer.encode) places in the buffer into the served model."""
        if self._asyncrl_buffer is None:
            raise RuntimeError(f"{LOAD} before {MAP}: the trainer has not shared its weight buffer")
        model = self.get_model()  # type: ignore[attr-defined] - vLLM's worker has it (defining it here would clash)
        model.load_weights(weight_buffer.views(self._asyncrl_buffer, weight_buffer.decode(layout)))
        if self._asyncrl_buffer.is_cuda:
            torch.cuda.current_stream().synchronize()  # the trainer rewrites the buffer as soon as this returns

    def asyncrl_unmap_weight_buffer(self) -> None:
        self._asyncrl_buffer = None

    def _asyncrl_device(self) -> int:
        device = getattr(self, "device", None)
        return (
            device.index
            if isinstance(device, torch.device) and device.index is not None
            else torch.cuda.current_device()
        )
