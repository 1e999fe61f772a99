"""One flat byte buffer holding the serving weights at fixed offsets, shared once by trainer and server.

The trainer allocates it once and shares it (a CUDA IPC handle the server opens once). A weight sync then
only copies the parameters into it and asks the server to load from it: no buffer, handle or clone per round.
The layout (name, dtype, shape, offset of every tensor) travels as JSON, because vLLM's /collective_rpc passes
string arguments. Imported inside vLLM's worker process too (weights/vllm_extension.py): torch and the
standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: every tensor starts where a CUDA kernel can read it vectorised


@dataclass(frozen=True)
class Slot:
    """Where one named tensor lives in the buffer."""

    name: str
    dtype: str
    """A torch attribute name: "bfloat16"."""
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def plan_chunks(entries: Iterable[tuple[str, torch.dtype, Sequence[int]]], limit: int) -> list[list[Slot]]:
    """Lay the tensors out in order, in chunks of at most ``limit`` bytes each (one chunk fills the buffer at a
    time). A tensor larger than ``limit`` gets a chunk of its own, and the buffer grows to hold it."""
    chunks: list[list[Slot]] = [[]]
    end = 0
    for name, dtype, shape in entries:
        slot = Slot(name, str(dtype).removeprefix("torch."), tuple(int(n) for n in shape), _aligned(end))
        if chunks[-1] and slot.offset + slot.nbytes > limit:
            chunks.append([])
            slot = Slot(slot.name, slot.dtype, slot.shape, 0)
        chunks[-1].append(slot)
        end = slot.offset + slot.nbytes
    return [chunk for chunk in chunks if chunk]


def chunk_bytes(chunk: Sequence[Slot]) -> int:
    """The buffer size one chunk needs."""
    return max((slot.offset + slot.nbytes for slot in chunk), default=0)


def encode(chunk: Sequence[Slot]) -> str:
    return json.dumps([[slot.name, slot.dtype, list(slot.shape), slot.offset] for slot in chunk])


def decode(layout: str) -> list[Slot]:
    return [Slot(name, dtype, tuple(shape), offset) for name, dtype, shape, offset in json.loads(layout)]


def views(buffer: torch.Tensor, chunk: Sequence[Slot]) -> list[tuple[str, torch.Tensor]]:
    """Each slot's tensor as a view into ``buffer`` (flat uint8): writing a view writes the buffer."""
    if chunk_bytes(chunk) > buffer.numel():
        raise ValueError(f"the layout needs {chunk_bytes(chunk)} bytes but the shared buffer has {buffer.numel()}")
    return [
        (slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape))
        for slot in chunk
    ]
