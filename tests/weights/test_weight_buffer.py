"""The shared weight buffer's layout: aligned, non-overlapping slots, chunked at a limit, views that alias it."""

from __future__ import annotations

import pytest
import torch

from asyncrl.weights import weight_buffer
from asyncrl.weights.weight_buffer import ALIGN, chunk_bytes, decode, encode, plan_chunks, views

ENTRIES = [("a", torch.bfloat16, [3, 5]), ("b", torch.float32, [7]), ("c", torch.int64, [2, 2]),
           ("d", torch.bfloat16, [1000])]  # fmt: skip


def test_slots_are_aligned_in_order_and_never_overlap():
    (chunk,) = plan_chunks(ENTRIES, limit=1 << 20)
    assert [slot.name for slot in chunk] == ["a", "b", "c", "d"]
    ends = 0
    for slot in chunk:
        assert slot.offset % ALIGN == 0 and slot.offset >= ends
        ends = slot.offset + slot.nbytes
    assert chunk_bytes(chunk) == ends == 3 * ALIGN + 2000


def test_chunks_respect_the_limit_and_an_oversize_tensor_gets_its_own():
    chunks = plan_chunks(ENTRIES, limit=ALIGN + 28)
    assert [[slot.name for slot in chunk] for chunk in chunks] == [["a", "b"], ["c"], ["d"]]
    assert [chunk_bytes(chunk) for chunk in chunks] == [ALIGN + 28, 32, 2000]  # "d" alone exceeds the limit
    assert all(chunk[0].offset == 0 for chunk in chunks)


def test_views_write_through_to_the_buffer_and_the_layout_survives_json():
    (chunk,) = plan_chunks(ENTRIES, limit=1 << 20)
    assert decode(encode(chunk)) == chunk
    buffer = torch.zeros(chunk_bytes(chunk), dtype=torch.uint8)
    tensors = {name: torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.arange(4).view(2, 2)
               for name, dtype, shape in ENTRIES}  # fmt: skip
    for name, view in views(buffer, chunk):
        view.copy_(tensors[name])
    for name, view in views(buffer, decode(encode(chunk))):
        assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name])
    with pytest.raises(ValueError, match="needs .* bytes but the shared buffer has"):
        weight_buffer.views(buffer[:100], chunk)
