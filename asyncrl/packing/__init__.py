"""Packers: how samples become rows. Registry `packing`; each entry makes empty rows of a token budget."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from asyncrl.packing.flat import FlatRow
from asyncrl.packing.planner import MicroBatchPlanner, plan_micro_batches
from asyncrl.packing.row import PackedRow, Segment
from asyncrl.packing.trie import TreeRow
from asyncrl.registry import Component, ComponentRegistry
from asyncrl.rollout.types import RolloutSample


class Row(Protocol):
    num_tokens: int
    samples: list[RolloutSample]

    def fits(self, sample: RolloutSample) -> bool: ...
    def add(self, sample: RolloutSample) -> None: ...
    def pack(self, top_k: int) -> PackedRow: ...


RowFactory = Callable[[], Row]


@dataclass(frozen=True)
class PackingOptions:
    token_budget: int | None = None
    """Tokens per row (unique tokens for tree packing); None = the server's max_model_len."""

    def __post_init__(self) -> None:
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget={self.token_budget} must be >= 1 (or null: the server's max_model_len)")


class Packer(Component):
    """A registered packer: which row layout samples are packed into, within a token budget."""

    Options: ClassVar[type] = PackingOptions
    options: PackingOptions
    row: ClassVar[Callable[[int], Row]]
    """The row class, built with the row's token budget."""

    def rows(self, max_model_len: int) -> tuple[RowFactory, int]:
        """A factory of empty rows and their token budget (the configured one, else ``max_model_len``)."""
        budget = self.options.token_budget or max_model_len
        return functools.partial(type(self).row, budget), budget


PACKERS: ComponentRegistry[Packer] = ComponentRegistry("packing", Packer)


@PACKERS.register("flat")
class Flat(Packer):
    """Padding-free packing: samples concatenated in a row, attention never crosses samples."""

    row = FlatRow


@PACKERS.register("tree")
class Tree(Packer):
    """Prefix-trie packing: a prefix shared by samples is forwarded once (the budget counts unique tokens)."""

    row = TreeRow


__all__ = [
    "PACKERS", "Flat", "FlatRow", "MicroBatchPlanner", "PackedRow", "Packer", "PackingOptions", "Row", "RowFactory",
    "Segment", "Tree", "TreeRow", "plan_micro_batches",
]  # fmt: skip
