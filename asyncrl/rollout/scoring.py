"""Scoring a group: every reward source runs concurrently; their sum is the rollout's reward.

Sync reward functions run in threads, `async def` ones are gathered on the loop. `None` means "not
applicable"; a rollout no source scored gets NaN. A function that raises, returns the wrong number of rewards or
a value that is not a number stops the run with a one-line error naming it and the dataset row. A group nothing
scored is dropped (too_few_scorable), and the trainer's group watch stops a run where that goes on
(trainer/group_watch.py).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.rollout.types import RolloutGroup


class RewardFunctionError(RuntimeError):
    """A reward function failed; the message names it."""


@dataclass(frozen=True)
class RewardSource:
    name: str
    fn: Callable[..., Any]


def reward_name(fn: Callable[..., Any]) -> str:
    """A stable name for metrics: the function's name, seen through partials and callable instances."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _is_async(fn: Callable[..., Any]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def _call(source: RewardSource, kwargs: dict[str, Any], expected: int, row: int) -> list[float | None]:
    where = f"reward function '{source.name}' on row {row}"
    try:
        if _is_async(source.fn):
            result = await source.fn(**kwargs)
        else:
            result = await asyncio.to_thread(source.fn, **kwargs)
    except Exception as exc:
        raise RewardFunctionError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if result is None or not hasattr(result, "__len__") or len(result) != expected:
        got = "None" if result is None else f"{len(result)} values" if hasattr(result, "__len__") else type(result)
        raise RewardFunctionError(f"{where} returned {got}; expected a list of {expected} (one per completion)")
    for i, value in enumerate(result):
        if value is not None and not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"{where} returned {type(value).__name__} {value!r:.40} for completion {i}; "
                                      "expected a number, or None where it does not apply")  # fmt: skip
    return [None if r is None else float(r) for r in result]


async def score_group(group: RolloutGroup, sources: Sequence[RewardSource]) -> dict[str, np.ndarray]:
    """Per source, one reward per rollout (NaN = not applicable): sets ``group.reward_components`` to them and
    ``group.rewards`` to their sum."""
    n = len(group.completions)
    kwargs = {
        "prompts": group.prompts,
        "completions": group.completions,
        "completion_ids": group.completions_ids,
        **group.reward_kwargs,
    }
    results = await asyncio.gather(*(_call(s, kwargs, n, group.row_index) for s in sources))
    per_source = {s.name: _as_array(r) for s, r in zip(sources, results, strict=True)}
    if any(r is not None for r in group.rollout_rewards):
        per_source["rollout"] = _as_array(group.rollout_rewards)
    for cls in dict.fromkeys(e[0] for e in group.env_rewards if e is not None):
        scores = [e[1] if e is not None and e[0] is cls else None for e in group.env_rewards]
        per_source[cls.__name__] = _as_array(scores)
    stacked = np.stack(list(per_source.values())) if per_source else np.full((1, n), np.nan)
    scored = ~np.isnan(stacked)
    total = np.where(scored, stacked, 0.0).sum(axis=0)
    group.rewards = np.where(scored.any(axis=0), total, np.nan)
    group.reward_components = per_source
    return per_source


def _as_array(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)
