"""Group scoring: sources run concurrently, None means not applicable, failures name the function."""

from __future__ import annotations

import asyncio
import functools
import math
import time

import numpy as np
import pytest

from asyncrl.rollout.scoring import (
    RewardFunctionError,
    RewardSource,
    _is_async,
    score_group,
)
from asyncrl.rollout.types import RolloutGroup


def make_group(n: int = 3, rollout_rewards=None, row_index: int = 0) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * n, reward_kwargs={"solution": ["1"] * n},
        completions=[[{"role": "assistant", "content": f"a{i}"}] for i in range(n)],
        completions_ids=[[1] * (i + 1) for i in range(n)], completions_sequences=[[] for _ in range(n)],
        tool_call_counts=[0] * n, tool_failure_counts=[0] * n, model_version=0, group_id=0, row_index=row_index,
        env_rewards=[None] * n, rollout_rewards=rollout_rewards or [None] * n,
    )  # fmt: skip


def by_length(prompts, completions, completion_ids, solution, **kw):
    assert solution == ["1", "1", "1"]  # dataset columns arrive as keyword lists
    return [float(len(c)) for c in completion_ids]


def only_first(completion_ids, **kw):
    return [1.0, None, None]


def never(completion_ids, **kw):
    return [None] * len(completion_ids)


def test_sum_of_sources_with_none_as_not_applicable():
    group = make_group(rollout_rewards=[None, 0.5, None])
    sources = [RewardSource("len", by_length), RewardSource("first", only_first), RewardSource("never", never)]
    per_source = asyncio.run(score_group(group, sources))
    assert np.allclose(group.rewards, [2.0, 2.5, 3.0])
    assert math.isnan(per_source["first"][1]) and set(per_source) == {"len", "first", "never", "rollout"}


def test_rollout_scored_by_no_source_is_nan():
    group = make_group()
    asyncio.run(score_group(group, [RewardSource("never", never)]))
    assert np.isnan(group.rewards).all()


def test_sync_functions_run_in_threads_and_async_ones_are_gathered():
    def slow_sync(completion_ids, **kw):
        time.sleep(1.0)
        return [0.0] * len(completion_ids)

    async def slow_async(completion_ids, **kw):
        await asyncio.sleep(1.0)
        return [0.0] * len(completion_ids)

    sources = [RewardSource(f"s{i}", slow_sync) for i in range(2)] + [RewardSource("a", slow_async)]
    started = time.monotonic()
    asyncio.run(score_group(make_group(), sources))
    assert time.monotonic() - started < 2.0  # three 1 s functions overlapped (one after another: 3 s)


def test_raising_or_wrong_length_names_the_function():
    def broken(completion_ids, **kw):
        raise KeyError("solution")

    def short(completion_ids, **kw):
        return [1.0]

    def words(completion_ids, **kw):
        return ["good"] * len(completion_ids)

    cases = {broken: r"^reward function 'broken' on row 5 raised KeyError: 'solution'$",
             short: r"^reward function 'short' on row 5 returned 1 values; expected a list of 3 \(one per completion",
             words: r"^reward function 'words' on row 5 returned str 'good' for completion 0; expected a number, or "
                    r"None where it does not apply$"}  # fmt: skip
    for fn, message in cases.items():
        with pytest.raises(RewardFunctionError, match=message):
            asyncio.run(score_group(make_group(row_index=5), [RewardSource(fn.__name__, fn)]))


def test_async_callable_objects_and_partials_count_as_async():
    class AsyncScorer:
        async def __call__(self, completion_ids, **kw):
            return [0.0] * len(completion_ids)

    class SyncScorer:
        def __call__(self, completion_ids, **kw):
            return [0.0] * len(completion_ids)

    assert _is_async(AsyncScorer()) and _is_async(functools.partial(AsyncScorer()))
    assert not _is_async(SyncScorer()) and not _is_async(functools.partial(len))
