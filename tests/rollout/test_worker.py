"""The rollout worker: as a process against a real built-in server, it stops when the trainer says so, even while
admission holds it back because nobody consumes its samples; as a driver in this process, on in-process channels,
its admission, samples, synchronous batches, failures and shutdown."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import json
import pickle
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.data import epoch_rows, load_train_prompts
from asyncrl.flow import FlowControl
from asyncrl.plan.assemble import plan_run
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.loop import AsyncRolloutLoop
from asyncrl.rollout.scoring import RewardSource
from asyncrl.rollout.spawn import send_spec, spawn_worker
from asyncrl.rollout.trainer_state import rollout_state
from asyncrl.rollout.types import EndOfBatch, PromptDone, RolloutSample, TurnRecord
from asyncrl.rollout.worker import WorkerDriver, WorkerSpec, prompts, run_worker
from asyncrl.serving.command import served_model_name
from asyncrl.trainer.setup import prepare


def test_a_worker_blocked_on_backpressure_stops_promptly(tiny_server, random_tiny_model_dir, arithmetic_data_dir):
    plan = plan_run(compose([
        f"model.name_or_path={random_tiny_model_dir}", f"data.path={Path(arithmetic_data_dir) / 'train.jsonl'}",
        "data.eval_path=null", "reward=length", "server.launch=false", f"server.base_url={tiny_server.base_url}",
    ]))  # fmt: skip
    config, components, prepared = plan.config, plan.components, prepare(plan)
    channels = WorkerChannels.create(64)  # a small allowance, and no trainer consumes: admission soon waits
    spec = WorkerSpec(
        config=config, tokenizer=prepared.tokenizer, dataset=prepared.dataset, reward_sources=components.rewards,
        loop_cls=prepared.loop_cls, advantage_fn=components.advantage, base_urls=[tiny_server.base_url],
        model_name=served_model_name(config), max_model_len=256, flow=plan.flow, adapter_prefix=None,
        start_prompt_index=0, total_prompts=None,
    )  # fmt: skip
    worker = spawn_worker(channels)
    send_spec(spec, channels)
    try:
        deadline = time.monotonic() + 60
        while "backpressure" not in channels.get_status():
            assert time.monotonic() < deadline, f"the worker never waited on admission: {channels.get_status()!r}"
            assert worker.is_alive(), "the worker exited early"
            time.sleep(0.1)
        stopped = time.monotonic()
        channels.stop()
        worker.join(timeout=10)
        assert not worker.is_alive() and worker.exitcode == 0
        assert time.monotonic() - stopped < 3.0  # it was waiting for room that would never come
        assert channels.failure() is None
    finally:
        if worker.is_alive():
            worker.kill()


def test_a_worker_spawned_ahead_of_its_spec_ends_when_stopped_without_one():
    """The trainer spawns the worker before the server is up; a run that fails before sending the spec stops it."""
    channels = WorkerChannels.create(1)
    worker = spawn_worker(channels)
    try:
        time.sleep(0.5)
        assert worker.is_alive()  # waiting for its spec
        channels.stop()
        worker.join(timeout=30)  # its imports may still be running
        assert not worker.is_alive() and worker.exitcode == 0 and channels.failure() is None
    finally:
        if worker.is_alive():
            worker.kill()


# ---- the driver in this process, on in-process channels, its one server request answered by the loop ----------


@functools.cache
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "asyncrl" / "assets" / "tiny-arith")


class GatedLoop(AsyncRolloutLoop):
    """The rollout loop with its server request answered here once the test opens the gate: 2 then 4 tokens,
    alternately, so that a group's rewards (their lengths) differ."""

    async def setup(self) -> None:
        self.gate, self.turns = asyncio.Event(), 0

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        await self.gate.wait()
        self.turns += 1
        n = 2 if self.turns % 2 else 4
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[11] * n, output_log_probs=[-0.5] * n)


class OpenLoop(GatedLoop):
    """Answers at once."""

    async def setup(self) -> None:
        await super().setup()
        self.gate.set()


def centred(rewards: np.ndarray, components: object) -> np.ndarray:
    return rewards - rewards.mean()


def by_length(completion_ids: list[list[int]], **_: object) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def failing(completion_ids: list[list[int]], **_: object) -> list[float]:
    raise ValueError("no reward today")


def local_spec(reward=by_length, total_prompts: int = 3, max_staleness: int = 1) -> WorkerSpec:
    config = Config()
    config.sampling.num_generations, config.staleness.max_staleness, config.data.shuffle = 2, max_staleness, False
    rows = [{"prompt": [{"role": "user", "content": f"{i} + {i} ="}], "answer": str(2 * i)} for i in range(3)]
    return WorkerSpec(
        config=config, tokenizer=tokenizer(), dataset=rows,
        reward_sources=[RewardSource(reward.__name__, reward)], loop_cls=GatedLoop, advantage_fn=centred,
        base_urls=["http://127.0.0.1:9"], model_name="tiny", max_model_len=256, flow=FlowControl.from_config(config),
        total_prompts=total_prompts,
    )  # fmt: skip


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the driver run until ``condition`` holds: it wakes on its own events, and reads the trainer's counters
    every POLL_S."""
    for _ in range(1_000_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the driver never got to {what}")


def sent(channels: WorkerChannels) -> list[object]:
    items = []
    while not channels.rollout_queue.empty():
        items.append(channels.rollout_queue.get_nowait())
    return items


def test_the_driver_admits_by_the_allowance_sends_samples_and_stops_when_asked():
    channels = WorkerChannels.create(1, in_process=True)  # one token: a second group waits for the trainer
    driver = WorkerDriver(local_spec(), channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: "backpressure" in channels.get_status() and channels.inflight_at(0) == 1, "one group")
        assert driver.admission.inflight_rollouts == 2  # at max_model_len each, the first group fills the allowance
        driver.loop.gate.set()
        await until(lambda: "backpressure" in channels.get_status() and channels.items_sent == 2, "backpressure")
        first = sent(channels)
        assert [type(item) for item in first] == [RolloutSample, RolloutSample] and channels.items_sent == 2
        assert [(s.prompt_index, s.reward, s.advantage, s.group_std) for s in first] == [
            (0, 2.0, -1.0, 1.0),
            (0, 4.0, 1.0, 1.0),
        ]
        assert first[0].sequence.token_ids[-2:] == [11, 11] and channels.inflight_at(0) == 0
        channels.consume(sum(s.num_tokens for s in first))  # the trainer: pulled them, and grants more
        channels.token_allowance = 10**6
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        rest = sent(channels)
        assert [s.prompt_index for s in rest[:-1]] == [1, 1, 2, 2] and rest[-1] == EndOfBatch(0)
        channels.stop()
        await run  # no error: a stop ends the worker, rollouts in flight or not

    asyncio.run(scenario())
    metrics = drained_metrics(channels)
    assert len(metrics["rollout/duration_s"]) == 6 and len(metrics["rollout/backpressure_s"]) >= 1


def drained_metrics(channels: WorkerChannels) -> dict[str, list[float]]:
    """Every metric the worker flushed (once per queued group and at its end), merged by name."""
    merged: dict[str, list[float]] = {}
    while not channels.metrics_queue.empty():
        for name, values in channels.metrics_queue.get_nowait().items():
            if name.startswith(("rollout/", "sample/")):
                merged.setdefault(name, []).extend(values)
    return merged


def test_a_synchronous_driver_closes_its_batch_and_waits_for_the_weight_sync():
    channels = WorkerChannels.create(1, in_process=True)
    driver = WorkerDriver(local_spec(max_staleness=0, total_prompts=2), channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: hasattr(driver, "loop") and hasattr(driver.loop, "gate"), "its setup")
        driver.loop.gate.set()
        await until(lambda: "waiting for weight sync to version 1" in channels.get_status(), "the batch's end")
        assert [type(item).__name__ for item in sent(channels)] == ["RolloutSample"] * 2 + ["EndOfBatch"]
        channels.model_version = 1  # the trainer synced: the next batch starts
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        assert [getattr(item, "prompt_index", None) for item in sent(channels)] == [1, 1, None]
        channels.stop()
        await run

    asyncio.run(scenario())


def test_a_synchronous_batch_holds_samples_per_step_samples_whatever_their_tokens():
    """trainer.samples_per_step=4 with groups of 2: each batch is two groups, though one token is the allowance."""
    channels = WorkerChannels.create(1, in_process=True)
    spec = local_spec(max_staleness=0, total_prompts=3)
    spec.config.trainer.samples_per_step = 4
    spec.flow = FlowControl.from_config(spec.config)
    driver = WorkerDriver(spec, channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: hasattr(driver, "loop") and hasattr(driver.loop, "gate"), "its setup")
        driver.loop.gate.set()
        await until(lambda: "waiting for weight sync to version 1" in channels.get_status(), "the batch's end")
        assert [getattr(item, "prompt_index", None) for item in sent(channels)] == [0, 0, 1, 1, None]
        channels.model_version = 1
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        assert [getattr(item, "prompt_index", None) for item in sent(channels)] == [2, 2, None]  # the prompts ended
        channels.stop()
        await run

    asyncio.run(scenario())


def text_reward(prompts, completions, completion_ids, answer, **_):
    assert all(isinstance(text, str) for text in [*prompts, *completions, *answer])  # TRL's standard format
    return [float(len(ids)) for ids in completion_ids]


def test_a_standard_prompt_is_tokenized_as_it_is_and_its_rewards_get_texts():
    channels = WorkerChannels.create(10**6, in_process=True)
    spec = local_spec(reward=text_reward, total_prompts=1)
    spec.dataset = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(3)]
    spec.config.logging.log_completions = True
    driver = WorkerDriver(spec, channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: hasattr(driver, "loop") and hasattr(driver.loop, "gate"), "its setup")
        driver.loop.gate.set()
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        samples = [item for item in sent(channels) if isinstance(item, RolloutSample)]
        prompt_ids = tokenizer()("0 + 0 =")["input_ids"]  # no chat template around it
        assert [s.sequence.token_ids for s in samples] == [prompt_ids + [11] * 2, prompt_ids + [11] * 4]
        channels.stop()
        await run

    asyncio.run(scenario())
    records = []
    while not channels.metrics_queue.empty():
        records.extend(channels.metrics_queue.get_nowait()["completions"])
    assert [r["prompt"] for r in records] == ["0 + 0 ="] * 2 and all(isinstance(r["completion"], str) for r in records)


def test_a_failing_reward_reaches_the_trainer_as_one_line_with_the_traceback():
    channels = WorkerChannels.create(10**6, in_process=True)
    spec = local_spec(reward=failing)
    spec.loop_cls = OpenLoop
    run_worker(spec, channels)
    line, trace = channels.failure()
    assert "failing" in line and "no reward today" in line and "Traceback" in trace
    channels.stop()  # the stop listener's thread ends too


def test_a_resumed_worker_skips_the_prompts_its_checkpoint_had_already_trained():
    """Groups finish out of order: the checkpoint's cursor is 1 while prompt 2 already trained. The resumed worker
    generates prompt 1 and not prompt 2 again."""
    channels = WorkerChannels.create(10**6, in_process=True)
    spec = local_spec(total_prompts=3)
    spec.loop_cls, spec.start_prompt_index, spec.skip_prompt_indices = OpenLoop, 1, frozenset({2})
    driver = WorkerDriver(spec, channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        assert [getattr(item, "prompt_index", None) for item in sent(channels)] == [1, 1, None]
        channels.stop()
        await run

    asyncio.run(scenario())


def test_a_stop_that_meets_a_wakeup_ends_the_driver_without_starting_a_group():
    """The stop arrives in the same turn of the event loop as the wake-up its main loop waited for, and admission
    has room again: the main loop still ends there, creating no group (a coroutine nobody awaits warns at exit)."""
    channels = WorkerChannels.create(1, in_process=True)
    driver = WorkerDriver(local_spec(), channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: hasattr(driver, "loop") and hasattr(driver.loop, "gate"), "its setup")
        driver.loop.gate.set()
        await until(lambda: "backpressure" in channels.get_status() and channels.items_sent == 2, "backpressure")
        channels.token_allowance = 10**6  # room again, which the main loop reads when it wakes up
        driver.changed.set()
        driver.stopping.set()  # as the stop listener does, in the same turn
        await run
        assert channels.items_sent == 2  # the first group only

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(scenario())
        gc.collect()
    channels.stop()  # the stop listener's thread ends too


def test_prompts_solved_k_times_in_a_row_retire_and_an_epoch_of_them_ends_the_prompts_saying_so():
    """data.retire_solved_after=1: the first group scores 0 and 1, every later one 1 for each rollout (solved). A
    solved prompt is not generated again (a PromptDone "retired"); once a whole epoch is, the prompts end with the
    line that says the task is solved."""
    channels = WorkerChannels.create(10**6, in_process=True)
    spec = local_spec(total_prompts=None)
    spec.loop_cls, spec.config.data.retire_solved_after = OpenLoop, 1
    spec.config.staleness.max_concurrent_rollouts = 2  # one group at a time: no racing through epochs
    spec.flow = FlowControl.from_config(spec.config)
    calls = iter(range(10**6))

    def learns_at_once(completion_ids: list[list[int]], **_: object) -> list[float]:
        return [0.0, 1.0] if next(calls) == 0 else [1.0] * len(completion_ids)

    spec.reward_sources = [RewardSource("learns_at_once", learns_at_once)]
    driver = WorkerDriver(spec, channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        items = sent(channels)
        retired = [item for item in items if isinstance(item, PromptDone) and item.reason == "retired"]
        assert len(retired) >= 3 and isinstance(items[-1], EndOfBatch)
        assert items[-1].solved.startswith("the task is solved for this model: every prompt of epoch ")
        line = items[-1].solved
        assert line.endswith("is retired, its last 1 group(s) scored 1 for every rollout, the highest reward of the "
                             "run (data.retire_solved_after=1); training ends here")  # fmt: skip
        channels.stop()
        await run

    asyncio.run(scenario())
    assert sum(drained_metrics(channels)["rollout/retired_prompt_count"]) >= 3


def test_a_streamed_split_feeds_the_worker_from_its_resume_point_and_its_rewards_see_the_epoch(tmp_path):
    """data.streaming: the worker reads the PromptStream (pickled to it) from the checkpoint's prompt on, pass after
    pass, as it would the same rows loaded whole; a reward's trainer_state.epoch is known once a pass has ended."""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i} + {i} =", "answer": str(2 * i)}) for i in range(3)))
    config = to_config(compose([f"data.path={path}", "data.streaming=true", "data.shuffle=false",
                                "trainer.max_steps=5"]))  # fmt: skip
    spec = local_spec()
    spec.config, spec.dataset, spec.total_prompts, spec.start_prompt_index = config, load_train_prompts(config), None, 2
    spec.dataset = pickle.loads(pickle.dumps(spec.dataset))
    taken = list(itertools.islice(prompts(spec), 5))
    assert [(p.index, p.row_index, p.row["answer"], p.epoch, p.ends_epoch) for p in taken] == [
        (2, 2, "4", 0, True), (3, 0, "0", 1, False), (4, 1, "2", 1, False), (5, 2, "4", 1, True), (6, 0, "0", 2, False)
    ]  # fmt: skip
    assert epoch_rows(spec.dataset) == 3 and rollout_state(config, 0, 4, epoch_rows(spec.dataset)).epoch == 4 / 3
    assert rollout_state(config, 0, 4, None).epoch == 0.0  # before the worker has read a pass to its end


class Overlap:
    """A sync reward that holds its call until another group's call overlaps it (or ``wait_s`` passes), and counts
    the most calls at once."""

    __name__ = "overlap"

    def __init__(self, wait_s: float) -> None:
        self.wait_s, self.lock, self.met = wait_s, threading.Lock(), threading.Event()
        self.now = self.most = 0

    def __call__(self, completion_ids: list[list[int]], **_: object) -> list[float]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            if self.now > 1:
                self.met.set()
        self.met.wait(self.wait_s)
        with self.lock:
            self.now -= 1
        return [float(len(ids)) for ids in completion_ids]


def scored_at_once(concurrency: int, wait_s: float) -> int:
    """The most groups the worker scored at once with rollout.score_concurrency=``concurrency``, over 4 groups."""
    channels = WorkerChannels.create(10**6, in_process=True)
    overlap = Overlap(wait_s)
    spec = local_spec(reward=by_length, total_prompts=4)
    spec.config.rollout.score_concurrency, spec.loop_cls = concurrency, OpenLoop
    spec.reward_sources = [RewardSource("overlap", overlap)]
    driver = WorkerDriver(spec, channels)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await until(lambda: "all prompts generated" in channels.get_status(), "the end of its prompts")
        channels.stop()
        await run

    asyncio.run(scenario())
    assert [type(item) for item in sent(channels)].count(RolloutSample) == 8  # every group scored and sent
    return overlap.most


def test_groups_are_scored_score_concurrency_at_a_time():
    """Groups scored at once: as many as rollout.score_concurrency allows, and never more."""
    assert scored_at_once(2, wait_s=1.0) == 2
    assert scored_at_once(1, wait_s=0.05) == 1  # one group at a time: no call ever meets another
