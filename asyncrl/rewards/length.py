"""Length reward: the spec's first custom-reward example, useful as a shaping term and for smoke tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.rewards.base import REWARDS


@REWARDS.register("length")
def length(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    *,
    target: int | None = None,
    scale: float = 1.0,
    **columns: Any,
) -> list[float | None]:
    """scale * tokens generated; with ``target``, scale * -|tokens - target| (closer to the target is better)."""
    if target is None:
        return [scale * len(ids) for ids in completion_ids]
    return [-scale * abs(len(ids) - target) for ids in completion_ids]
