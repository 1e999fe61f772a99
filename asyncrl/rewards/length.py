"""Length reward: the spec's first custom-reward example, useful as a shaping term and for smoke tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.rewards.base import REWARDS, Reward


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


@dataclass(frozen=True)
class LengthOptions:
    target: int | None = None
    """None: reward the length itself; a value: the distance to it, negated."""
    scale: float = 1.0


@REWARDS.register("length")
class Length(Reward):
    """``length`` with its options."""

    Options = LengthOptions
    options: LengthOptions

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                 **columns: Any) -> list[float | None]:  # fmt: skip
        return length(prompts, completions, completion_ids, target=self.options.target, scale=self.options.scale)
