"""Flat (padding-free) packing: samples laid end to end, position ids restart, attention never crosses samples."""

from __future__ import annotations

import torch

from asyncrl.packing.images import row_images
from asyncrl.packing.row import PackedRow, Segment, loss_slots
from asyncrl.rollout.types import RolloutSample


class FlatRow:
    """Planner state of one row: samples whose total token count stays within the budget."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.samples: list[RolloutSample] = []
        self.num_tokens = 0

    def fits(self, sample: RolloutSample) -> bool:
        return self.num_tokens + sample.num_tokens <= self.token_budget

    def add(self, sample: RolloutSample) -> None:
        self.samples.append(sample)
        self.num_tokens += sample.num_tokens

    def pack(self, top_k: int) -> PackedRow:
        input_ids, position_ids, segments, offsets = [], [], [], []
        for sample in self.samples:
            start = len(input_ids)
            tokens = sample.sequence.token_ids
            input_ids.extend(tokens)
            position_ids.extend(range(len(tokens)))
            segments.append(Segment(start, start + len(tokens), torch.arange(start, start + len(tokens))))
            offsets.append(list(range(start, start + len(tokens))))
        slots = loss_slots(self.samples, offsets, top_k)
        return PackedRow(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            position_ids=torch.tensor(position_ids, dtype=torch.long),
            segments=segments,
            samples=list(self.samples),
            images=row_images(self.samples, offsets),
            **slots,  # type: ignore[arg-type]
        )
