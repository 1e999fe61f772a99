"""Packers: how samples become rows. Registry `packing`; each entry builds a row factory for a token budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.packing.flat import FlatRow
from asyncrl.packing.planner import MicroBatchPlanner, plan_micro_batches
from asyncrl.packing.row import PackedRow, Segment
from asyncrl.packing.trie import TreeRow
from asyncrl.registry import Registry
from asyncrl.rollout.types import RolloutSample


class Row(Protocol):
    num_tokens: int
    samples: list[RolloutSample]

    def fits(self, sample: RolloutSample) -> bool: ...
    def add(self, sample: RolloutSample) -> None: ...
    def pack(self, top_k: int) -> PackedRow: ...


RowFactory = Callable[[], Row]
PACKERS: Registry[Callable[..., RowFactory]] = Registry("packing")


@PACKERS.register("flat")
def flat(*, token_budget: int | None = None, default_budget: int = 4096, attention: str = "auto",
         compile_layers: bool | str = "auto") -> RowFactory:  # fmt: skip
    """Padding-free packing; token_budget (None = the server's max_model_len) bounds each row's tokens;
    compile_layers: torch.compile the decoder layers (true, false, auto = on CUDA)."""
    check_attention(attention)
    check_compile_layers(compile_layers)
    budget = token_budget or default_budget
    return lambda: FlatRow(budget)


@PACKERS.register("tree")
def tree(*, token_budget: int | None = None, default_budget: int = 4096, attention: str = "auto",
         compile_layers: bool | str = "auto") -> RowFactory:  # fmt: skip
    """Prefix-trie packing; token_budget (None = the server's max_model_len) bounds each row's unique tokens;
    compile_layers as for flat."""
    check_attention(attention)
    check_compile_layers(compile_layers)
    budget = token_budget or default_budget
    return lambda: TreeRow(budget)


def check_attention(attention: str) -> None:
    """Fail at startup on an unknown attention backend name (the error lists the registered ones)."""
    from asyncrl.packing.attention import ATTENTION

    ATTENTION.get(attention)


def check_compile_layers(compile_layers: bool | str) -> None:
    """Fail at startup on a compile_layers value other than true, false or auto."""
    import torch

    from asyncrl.trainer.forward import resolve_compile

    resolve_compile(compile_layers, torch.device("cpu"))


def build_row_factory(spec: dict[str, Any], default_budget: int) -> tuple[RowFactory, int]:
    """The configured packer and its effective token budget."""
    budget = int(spec.get("token_budget") or default_budget)
    return PACKERS.build({**spec, "token_budget": budget})(), budget


__all__ = [
    "PACKERS", "MicroBatchPlanner", "PackedRow", "Row", "RowFactory", "Segment", "TreeRow", "build_row_factory",
    "check_attention", "check_compile_layers", "flat", "plan_micro_batches", "tree",
]  # fmt: skip
