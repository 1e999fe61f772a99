"""Scoring a group: every reward source runs concurrently; their sum, weighted by reward_weights, is the rollout's
reward.

Sync reward functions run in threads, `async def` ones are gathered on the loop. `None` means "not
applicable"; a rollout no source scored gets NaN. A function that raises, returns the wrong number of rewards or
a value that is not a number stops the run with a one-line error naming it and the dataset row. A group nothing
scored is dropped (too_few_scorable), and the trainer's group watch stops a run where that goes on
(trainer/group_watch.py).

Beside the dataset's columns, a function gets what TRL's GRPOTrainer hands its reward functions, where it takes them
(by name or through ``**kwargs``): ``trainer_state`` (rollout/trainer_state.py), ``log_metric(name, value)`` (a
scalar for the run's metrics), ``log_extra(column, values)`` (a column of the completions table) and, with
rollout.environment_factory, ``environments`` (the instance each completion ran in, its episode's state intact).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.rollout.trainer_state import RolloutState
from asyncrl.rollout.types import RolloutGroup


class RewardFunctionError(RuntimeError):
    """A reward function failed; the message names it."""


@dataclass(frozen=True)
class RewardSource:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    """Its reward_weights entry: how much its rewards count in the rollout's reward."""


TABLE_COLUMNS = ("prompt", "completion", "reward", "advantage")
"""The completions table's own columns, which ``log_extra`` cannot replace."""


def table_columns(records: Sequence[dict[str, Any]]) -> list[str]:
    """The completions table's columns for ``records`` (rollout/group_metrics.py's rows): its own, then the
    ``log_extra`` columns in the order they first appear (a record may lack one)."""
    return [*TABLE_COLUMNS, *dict.fromkeys(key for r in records for key in r if key not in TABLE_COLUMNS)]


class RewardLog:
    """The ``log_metric`` and ``log_extra`` a group's reward functions get; sync ones call them from threads."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.columns: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

    def log_metric(self, name: str, value: float) -> None:
        """A scalar for the run's metrics under ``name``, reduced over the logging window as every metric is."""
        if not isinstance(value, numbers.Real):
            raise TypeError(f"log_metric({name!r}, {value!r:.40}): the value must be a number")
        with self._lock:
            self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """A column of the completions table (logging.log_completions): one value per completion of the group."""
        if column in TABLE_COLUMNS:
            raise ValueError(f"log_extra({column!r}, ...): '{column}' is a column of the completions table already")
        values = list(values)
        if len(values) != self.group_size:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values; expected {self.group_size}, one "
                             "per completion")  # fmt: skip
        with self._lock:
            self.columns[str(column)] = values


def taken(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The ``offered`` arguments that ``fn`` takes: those it names, or all of them through a ``**kwargs``. A
    function written before they existed, naming its columns alone, keeps working."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return offered
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return offered
    names = {p.name for p in parameters}
    return {key: value for key, value in offered.items() if key in names}


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


async def score_group(
    group: RolloutGroup, sources: Sequence[RewardSource], trainer_state: Callable[[], Any] | None = None
) -> dict[str, np.ndarray]:  # fmt: skip
    """Per source, one reward per rollout (NaN = not applicable): sets ``group.reward_components`` to them,
    ``group.rewards`` to their weighted sum, and what the functions logged. ``trainer_state``: makes what the
    functions that take one get as theirs (rollout/trainer_state.py); a blank one where none is given (evaluation)."""
    n = len(group.completions)
    log = RewardLog(n)
    kwargs = {
        "prompts": group.prompts,
        "completions": group.completions,
        "completion_ids": group.completions_ids,
        **group.reward_kwargs,
    }
    offered = {"trainer_state": None, "log_metric": log.log_metric, "log_extra": log.log_extra}
    if any(r.env is not None for r in group.rollouts):
        offered["environments"] = [r.env for r in group.rollouts]
    extra = [taken(s.fn, offered) for s in sources]
    if any("trainer_state" in e for e in extra):
        state = trainer_state() if trainer_state is not None else RolloutState()
        extra = [e | {"trainer_state": state} if "trainer_state" in e else e for e in extra]
    calls = (_call(s, kwargs | e, n, group.row_index) for s, e in zip(sources, extra, strict=True))
    results = await asyncio.gather(*calls)
    per_source = {s.name: _as_array(r) for s, r in zip(sources, results, strict=True)}
    weights = {s.name: s.weight for s in sources}
    if any(r is not None for r in group.rollout_rewards):
        per_source["rollout"] = _as_array(group.rollout_rewards)
    for cls in dict.fromkeys(e[0] for e in group.env_rewards if e is not None):
        scores = [e[1] if e is not None and e[0] is cls else None for e in group.env_rewards]
        per_source[cls.__name__] = _as_array(scores)
    stacked = np.stack(list(per_source.values())) if per_source else np.full((1, n), np.nan)
    scored = ~np.isnan(stacked)
    weight = np.array([weights.get(name, 1.0) for name in per_source] or [1.0])[:, None]  # 1: env and rollout
    total = (np.where(scored, stacked, 0.0) * weight).sum(axis=0)
    group.rewards = np.where(scored.any(axis=0), total, np.nan)
    group.reward_components = per_source
    group.reward_metrics, group.extra_columns = dict(log.metrics), log.columns
    return per_source


def _as_array(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)
