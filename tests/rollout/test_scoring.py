"""Group scoring: sources run concurrently, None means not applicable, failures name the function."""

from __future__ import annotations

import asyncio
import functools
import math
import time

import numpy as np
import pytest

from asyncrl.advantages import ADVANTAGES, group_zscore
from asyncrl.config.schema import Config
from asyncrl.rollout.group_metrics import completion_records, group_metrics
from asyncrl.rollout.scoring import (
    RewardFunctionError,
    RewardSource,
    _is_async,
    score_group,
)
from asyncrl.rollout.trainer_state import rollout_state
from asyncrl.rollout.types import Rollout, RolloutGroup


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


def test_reward_weights_weigh_the_sum_and_leave_the_components_unweighted():
    group = make_group(rollout_rewards=[None, 0.5, None])
    sources = [RewardSource("len", by_length, 2.0), RewardSource("first", only_first, -0.5)]
    per_source = asyncio.run(score_group(group, sources))
    assert np.allclose(group.rewards, [2 * 1 - 0.5, 2 * 2 + 0.5, 2 * 3])  # the rollout's own reward weighs 1
    assert np.allclose(per_source["len"], [1.0, 2.0, 3.0]) and per_source["first"][0] == 1.0


def test_reward_weights_reach_the_sum_and_gdpo_from_the_config():
    from asyncrl.components import build_components
    from asyncrl.config.compose import compose, to_config

    config = to_config(compose(["advantage=gdpo", "reward_funcs=[{name: length}, {name: format}]",
                                "reward_weights=[0.5,3.0]"]))  # fmt: skip
    components = build_components(config)
    assert [(s.name, s.weight) for s in components.rewards] == [("length", 0.5), ("format", 3.0)]
    rewards = np.array([0.5 * 1.0 + 3.0, 0.5 * 3.0, 0.5 * 2.0])
    parts = {"length": np.array([1.0, 3.0, 2.0]), "format": np.array([1.0, 0.0, 0.0])}
    unweighted = ADVANTAGES.build("gdpo")(rewards, parts)
    weighted = components.advantage(rewards, parts)
    assert np.allclose(weighted, 0.5 * group_zscore(parts["length"]) + 3.0 * group_zscore(parts["format"]))
    assert not np.allclose(weighted, unweighted)


def test_a_reward_gets_the_trainer_state_and_logs_metrics_and_completion_columns_as_trl_gives_them():
    seen = {}

    def judged(completions, trainer_state, log_metric, log_extra, **columns):
        seen["state"] = trainer_state
        log_extra("judge_note", [f"note {i}" for i in range(len(completions))])
        log_metric("judge/agreement", 0.75)
        return [1.0, 0.0, 1.0]

    def by_columns(prompts, completions, completion_ids, solution):  # takes none of them, so it gets none
        return [0.0] * len(completion_ids)

    config = Config()
    config.staleness.weight_sync_steps, config.trainer.max_steps = 2, 100
    group = make_group()
    state = rollout_state(config, model_version=3, prompt_index=15, num_rows=10)
    sources = [RewardSource("judged", judged), RewardSource("by_columns", by_columns)]
    asyncio.run(score_group(group, sources, lambda: state))
    assert seen["state"] is state
    assert (seen["state"].global_step, seen["state"].max_steps, seen["state"].epoch) == (6, 100, 1.5)
    assert (seen["state"].model_version, seen["state"].prompts_seen) == (3, 15)
    assert group.reward_metrics == {"judge/agreement": [0.75]}
    assert group_metrics(group, group.reward_components, None)["judge/agreement"] == [0.75]
    records = completion_records(group, np.zeros(3))
    assert [r["judge_note"] for r in records] == ["note 0", "note 1", "note 2"] and records[0]["reward"] == 1.0


def test_with_environments_a_reward_reads_the_instance_each_completion_ran_in():
    class Counter:
        def __init__(self, count: int) -> None:
            self.count = count

    def by_state(completions, environments, **columns):
        return [float(env.count) for env in environments]

    def unaware(completions, **kw):  # without environments the rollouts offer none: a plain run's functions
        assert "environments" not in kw
        return [0.0] * len(completions)

    group = make_group()
    group.rollouts = [Rollout(completion=c, completion_ids=[1], turns=[], env=Counter(i)) for i, c in
                      enumerate(group.completions)]  # fmt: skip
    asyncio.run(score_group(group, [RewardSource("by_state", by_state)]))
    assert list(group.rewards) == [0.0, 1.0, 2.0]
    plain = make_group()
    plain.rollouts = [Rollout(completion=c, completion_ids=[1], turns=[]) for c in plain.completions]
    asyncio.run(score_group(plain, [RewardSource("unaware", unaware)]))
    assert list(plain.rewards) == [0.0, 0.0, 0.0]


def test_a_bad_log_call_names_the_reward_function():
    def wrong_column(completions, log_extra, **_):
        log_extra("notes", ["only one"])
        return [0.0] * len(completions)

    def wrong_metric(completions, log_metric, **_):
        log_metric("judge", "high")
        return [0.0] * len(completions)

    cases = {wrong_column: r"^reward function 'wrong_column' on row 0 raised ValueError: log_extra\('notes', \.\.\.\) "
                           r"got 1 values; expected 3, one per completion$",
             wrong_metric: r"^reward function 'wrong_metric' on row 0 raised TypeError: log_metric\('judge', "
                           r"'high'\): the value must be a number$"}  # fmt: skip
    for fn, message in cases.items():
        with pytest.raises(RewardFunctionError, match=message):
            asyncio.run(score_group(make_group(), [RewardSource(fn.__name__, fn)]))


def test_a_prompts_images_go_into_its_completions_rows_as_thumbnails_when_asked():
    """logging.log_multimodal: each row's prompt images as PNG thumbnails at most 128 pixels a side; the prompt's
    text shows where each image stood."""
    import io

    from PIL import Image

    group = make_group(2)
    image = Image.new("RGB", (400, 100), "red")
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "How many?"}]
    group.prompts = [[{"role": "user", "content": parts}], [{"role": "user", "content": "text only"}]]
    group.rewards = np.array([1.0, 0.0])
    records = completion_records(group, np.zeros(2), images=True)
    assert records[0]["prompt"] == "<image>How many?" and "images" not in records[1]
    (small,) = records[0]["images"]
    assert Image.open(io.BytesIO(small)).size == (128, 32)
    assert "images" not in completion_records(group, np.zeros(2), images=False)[0]
