"""The rollout worker process: streams prompts through the loop's hooks, scores groups, queues samples.

Spawned by trainer rank 0 (``spawn_worker``, then ``send_spec``) with no GPU and no distributed variables. The
driver walks the prompt stream in the recorded order, starts a group only when admission control allows it (the
token allowance, and the smaller of the KV-load and staleness caps on rollouts in flight, and room in the
scoring queue), scores the finished groups one at a time from that queue, feeds each one's lag to the staleness
pacer, and pushes samples (or a ``PromptDone`` for a dropped/filtered prompt, or a group whose prompt was too long
or whose generation failed after the client's retries) to the trainer. Any other exception reaches the trainer
with its traceback; a dead parent ends the worker.
"""

from __future__ import annotations

import asyncio
import os
import queue
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.client import ServerError
from asyncrl.flow import FlowControl
from asyncrl.rollout.admission import WorkerFlow
from asyncrl.rollout.channels import PromptDone, WorkerChannels
from asyncrl.rollout.concurrency import LoadPoller
from asyncrl.rollout.loop import PromptTooLong
from asyncrl.rollout.scoring import RewardFunctionError, RewardSource, score_group
from asyncrl.rollout.types import EndOfBatch, Rollout, RolloutGroup, RolloutSample


@dataclass
class WorkerSpec:
    """Everything the worker needs; pickled at spawn (checked beforehand by the trainer)."""

    config: Any
    tokenizer: Any
    dataset: Any
    reward_sources: list[RewardSource]
    loop_cls: type
    advantage_fn: Any
    base_url: str
    model_name: str
    max_model_len: int
    adapter_prefix: str | None = None
    """Set under adapter-only LoRA sync: each policy version is served as its own adapter (client.policy_model)."""
    start_prompt_index: int = 0
    total_prompts: int | None = None
    """Stop after this global prompt index (epoch-based runs); None = cycle epochs until stopped."""
    parent_pid: int = field(default_factory=os.getpid)


def prompt_order(num_rows: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Dataset row of each position in an epoch: a seeded permutation, the same on resume."""
    if not shuffle:
        return np.arange(num_rows)
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def rollout_tokens(rollout: Rollout) -> int:
    """Prompt and output tokens of every turn: what the rollout costs against the token allowance."""
    return sum(len(t.prompt_ids) + len(t.output_ids) for t in rollout.turns)


@dataclass
class ScoreJob:
    """A generated group waiting in the scoring queue, with what sending its samples needs."""

    group: RolloutGroup
    prompt_index: int
    epoch: int
    version: int
    generated: int
    """Tokens of its rollouts, as admission counted them."""


class StopRequested(Exception):
    """The trainer set the stop event: the worker ends now, rollouts in flight included."""


class WorkerDriver:
    def __init__(self, spec: WorkerSpec, channels: WorkerChannels, loop: Any) -> None:
        self.spec, self.channels, self.loop = spec, channels, loop
        self.config = spec.config
        self.flow = WorkerFlow(FlowControl.from_config(self.config))
        self.admission = self.flow.admission
        self.inflight_versions: Counter[int] = Counter()
        """Groups generating, by the policy version they started under."""
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.generation_spans: list[tuple[float, float]] = []
        self.completion_records: list[dict[str, Any]] = []
        self.generated_tokens = 0
        self.group_ids = iter(range(10**12))
        self.score_queue: asyncio.Queue[ScoreJob] = asyncio.Queue(self.config.rollout.score_queue_maxsize)
        self._orders: dict[int, np.ndarray] = {}

    # ---- main loop -------------------------------------------------------------------------------------------

    async def run(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from asyncrl.rollout.environments import Agents

        tool_pool = ThreadPoolExecutor(self.config.staleness.max_concurrent_rollouts, thread_name_prefix="tool")
        self.loop.tool_pool = tool_pool
        self.agents = Agents.from_config(self.config, tool_pool)
        try:
            await self._run_loop()
        finally:
            tool_pool.shutdown(wait=False, cancel_futures=True)

    async def _run_loop(self) -> None:
        await self.loop.setup()
        poller = LoadPoller(self.spec.base_url, self.flow.concurrency, self.flow.rollout_counts, self.metrics)
        try:
            await poller.start(self.spec.max_model_len)
            async with asyncio.TaskGroup() as tasks:
                background = [asyncio.create_task(self._report()), asyncio.create_task(self._watch_parent()),
                              asyncio.create_task(poller.run()), tasks.create_task(self._watch_stop()),
                              tasks.create_task(self._score_loop())]  # fmt: skip
                try:
                    await self._drive(tasks)
                finally:
                    for task in background:
                        task.cancel()
        except* StopRequested:
            # nobody reads the queues any more: exiting must not wait for their buffered items to be flushed
            self.channels.rollout_queue.cancel_join_thread()
            self.channels.metrics_queue.cancel_join_thread()
        finally:
            await poller.aclose()
            await self.loop.close()
            self._flush_metrics()

    async def _watch_stop(self) -> None:
        """Raise StopRequested once the trainer sets the stop event: the task group then cancels the driver and
        every group in flight, wherever they wait (admission backpressure waits for as long as nobody trains)."""
        while not self.channels.stop_event.is_set():
            await asyncio.sleep(0.05)
        raise StopRequested

    async def _drive(self, tasks: asyncio.TaskGroup) -> None:
        n_rows = len(self.spec.dataset)
        index = self.spec.start_prompt_index
        accepted_in_epoch: dict[int, int] = defaultdict(int)
        while not self.channels.stop_event.is_set():
            if self.spec.total_prompts is not None and index >= self.spec.total_prompts:
                break
            epoch, position = divmod(index, n_rows)
            row_index = int(self._order(epoch)[position])
            row = self.spec.dataset[row_index]
            if not self.loop.filter_prompt(row_index, row, epoch):
                self._push(PromptDone(index, "filtered"))
            else:
                accepted_in_epoch[epoch] += 1
                await self._admit()
                self.admission.on_group_start()
                tasks.create_task(self._run_group(index, row_index, row, epoch))
            if position == n_rows - 1 and accepted_in_epoch[epoch] == 0:
                raise RuntimeError(f"filter_prompt rejected every prompt of epoch {epoch}: no batch can be trained")
            index += 1
        await self._wait_idle()
        self._push(EndOfBatch(self.channels.model_version.value))
        self.channels.beat("all prompts generated; waiting for the trainer to stop")

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: prompt_order(len(self.spec.dataset), epoch, self.config.trainer.seed,
                                                self.config.data.shuffle)}  # fmt: skip
        return self._orders[epoch]

    async def _admit(self) -> None:
        """Wait until a new group may start; in synchronous mode close the batch at the allowance."""
        waited_since: float | None = None
        clock = self.flow.clock
        while True:
            reason = self.flow.wait_reason(self.channels.token_allowance.value, self.channels.tokens_consumed.value,
                                           self.score_queue.full())  # fmt: skip
            if reason is None:
                break
            waited_since = waited_since or clock()
            if self.flow.closes_batch(reason):
                await self._end_sync_batch()
                continue
            self.channels.beat(f"admission: {reason} ({self.admission.inflight_rollouts} rollouts in flight)")
            await asyncio.sleep(0.01)
        if waited_since is not None:
            self.metrics["rollout/backpressure_s"].append(clock() - waited_since)

    async def _end_sync_batch(self) -> None:
        """max_staleness=0: finish in-flight groups, mark the batch, wait for the trainer's weight sync."""
        await self._wait_idle()
        if self.flow.batch_has_room(self.channels.token_allowance.value):
            return  # dropped groups left room: generate more under the same weights
        version = self.channels.model_version.value
        self._push(EndOfBatch(version))
        while self.channels.model_version.value == version and not self.channels.stop_event.is_set():
            self.channels.beat(f"synchronous mode: waiting for weight sync to version {version + 1}")
            await asyncio.sleep(0.01)
        self.flow.start_batch()

    async def _wait_idle(self) -> None:
        while self.admission.inflight_groups > 0:
            self.channels.beat(f"waiting for {self.admission.inflight_rollouts} rollouts in flight")
            await asyncio.sleep(0.01)

    # ---- one group -------------------------------------------------------------------------------------------

    async def _run_group(self, prompt_index: int, row_index: int, row: dict[str, Any], epoch: int) -> None:
        """Generate the group and queue it for scoring (``_score_loop`` sends its samples), or drop it here."""
        from asyncrl.client import ROLLOUT_MODEL, policy_model

        version = self.channels.model_version.value
        self._generating(version, +1)
        started = time.time()
        ROLLOUT_MODEL.set(policy_model(self.spec.model_name, self.spec.adapter_prefix, version))  # this task only
        group_id = next(self.group_ids)
        outcomes = await asyncio.gather(*(self._one_rollout(row, group_id)
                                          for _ in range(self.config.sampling.num_generations)),
                                        return_exceptions=True)  # fmt: skip
        rollouts = [r for r in outcomes if isinstance(r, Rollout)]
        if len(rollouts) < len(outcomes):
            errors = [e for e in outcomes if not isinstance(e, Rollout)]
            self._drop_ungenerated(prompt_index, version, rollouts, errors)
            return
        group = self.loop.build_group(row.get("prompt") or [], row, rollouts, group_id=group_id,
                                      row_index=row_index, model_version=version)  # fmt: skip
        self.generation_spans.append((started, time.time()))
        blocked = time.monotonic()
        await self.score_queue.put(ScoreJob(group, prompt_index, epoch, version, sum(map(rollout_tokens, rollouts))))
        group.queued_at = time.monotonic()  # before the scorer can run: this task has not yielded since the put
        self.metrics["rollout/score_block_s"].append(group.queued_at - blocked)

    def _generating(self, version: int, change: int) -> None:
        """Count a group in flight under ``version`` and publish the counts (the trainer waits for a group that
        must train in its next step rather than drop it: trainer/assembler.py)."""
        self.inflight_versions[version] += change
        if not self.inflight_versions[version]:
            del self.inflight_versions[version]
        self.channels.publish_inflight(self.inflight_versions)

    def _drop_ungenerated(self, prompt_index: int, version: int, rollouts: list[Rollout],
                          errors: list[BaseException]) -> None:  # fmt: skip
        """A group whose prompt is too long (data.max_prompt_length, or the server's context) is skipped and one
        whose request failed after the client's retries is dropped, each counted; the trainer stops a run where
        too many fail. Any other exception is a bug, and ends the run."""
        error = next((e for e in errors if not isinstance(e, (PromptTooLong, ServerError))), errors[0])
        if not isinstance(error, (PromptTooLong, ServerError)):
            raise error
        reason = "prompt_too_long" if isinstance(error, PromptTooLong) else "failed"
        self.metrics["rollout/skipped_long_prompt_count" if reason == "prompt_too_long" else
                     "rollout/failed_group_count"].append(1.0)  # fmt: skip
        self.admission.on_group_done(0, sum(map(rollout_tokens, rollouts)))
        self._push(PromptDone(prompt_index, reason, detail=str(error)[:500]))
        self._generating(version, -1)
        self.channels.beat(f"group dropped: {reason}")

    async def _score_loop(self) -> None:
        """Score the queued groups one at a time, in the order their generation finished."""
        while True:
            job = await self.score_queue.get()
            self.metrics["rollout/score_wait_s"].append(time.monotonic() - job.group.queued_at)
            await self._score(job)

    async def _score(self, job: ScoreJob) -> None:
        """Score, compute advantages, send the samples (or a PromptDone saying why the group was dropped)."""
        from asyncrl.advantages import group_drop_reason, silent_rewards

        group = job.group
        started = time.monotonic()
        per_source = await score_group(group, self.spec.reward_sources)
        self.metrics["rollout/score_s"].append(time.monotonic() - started)
        advantages = np.asarray(self.loop.compute_advantages(group), dtype=np.float64)
        drop = group_drop_reason(group.rewards)
        self._record_group(group, per_source, drop, advantages)
        self._pace(job.version)
        if drop is not None:
            self.admission.on_group_done(0, job.generated)
            self._push(PromptDone(job.prompt_index, drop, *silent_rewards(per_source)))
        else:
            samples = self._samples(group, advantages, per_source, job.prompt_index, job.epoch)
            self.admission.on_group_done(sum(s.num_tokens for s in samples), job.generated)
            for sample in samples:
                self._push(sample)
        self._generating(job.version, -1)  # after its samples are sent (and counted): the trainer drains them
        self.channels.beat("group queued")

    def _pace(self, start_version: int) -> None:
        """Feed the group's lag to the staleness pacer, before its samples join the queue."""
        late = self.flow.on_group_queued(start_version, self.channels.model_version.value)
        if late is not None:
            self.metrics["rollout/late_group_count"].append(float(late))

    async def _one_rollout(self, row: dict[str, Any], group_id: int) -> Rollout:
        started = time.monotonic()
        try:
            episode = await self.agents.begin(row)
            rollout = await self.loop.generate_one(episode.prompt, episode.tools, group_id)
        except BaseException:
            self.admission.on_rollout_failed()
            raise
        rollout.env_reward, reward_s = await self.agents.end(episode)
        for name, seconds in (("env/reset_s", episode.reset_s), ("env/reward_s", reward_s)):
            if seconds is not None:
                self.metrics[name].append(seconds)
        self.metrics["rollout/duration_s"].append(time.monotonic() - started)
        self.generated_tokens += sum(len(t.output_ids) for t in rollout.turns)
        self.admission.on_rollout_done(rollout_tokens(rollout))
        self.channels.beat("rollout done")
        return rollout

    def _samples(
        self, group: RolloutGroup, advantages: np.ndarray, per_source: dict[str, np.ndarray], prompt_index: int,
        epoch: int,
    ) -> list[RolloutSample]:  # fmt: skip
        assert group.rewards is not None
        scored = group.rewards[~np.isnan(group.rewards)]
        group_std = float(np.std(scored)) if scored.size else 0.0
        components = {name: (np.nanstd(values) if np.isfinite(values).any() else np.nan)
                      for name, values in per_source.items()}  # fmt: skip
        samples = []
        for i, (rollout, sequences) in enumerate(zip(group.rollouts, group.completions_sequences, strict=True)):
            for sequence in sequences:
                samples.append(RolloutSample(
                    sequence=sequence, advantage=float(advantages[i]), reward=float(group.rewards[i]),
                    group_id=group.group_id, row_index=group.row_index, prompt_index=prompt_index,
                    model_version=group.model_version,
                    rollout_id=rollout.rollout_id, epoch=epoch, group_std=group_std,
                    reward_components={f"rewards/{n}/group_std": float(s) for n, s in components.items()},
                    queued_at=time.time(),
                ))  # fmt: skip
        return samples

    def _record_group(
        self, group: RolloutGroup, per_source: dict[str, np.ndarray], drop: str | None, advantages: np.ndarray
    ) -> None:
        from asyncrl.rollout.group_metrics import completion_records, group_metrics

        for name, values in group_metrics(group, per_source, drop).items():
            self.metrics[name].extend(values)
        if self.config.logging.log_completions:
            self.completion_records.extend(completion_records(group, advantages))

    # ---- plumbing --------------------------------------------------------------------------------------------

    def _push(self, item: Any) -> None:
        self.channels.send(item)

    def _flush_metrics(self) -> None:
        if self.metrics or self.generation_spans or self.completion_records:
            self.channels.metrics_queue.put({**self.metrics, "timeline": {"generation": self.generation_spans},
                                             "completions": self.completion_records})  # fmt: skip
            self.metrics.clear()  # in place: the load poller holds this dict
            self.generation_spans, self.completion_records = [], []

    async def _report(self, interval_s: float = 1.0) -> None:
        last_time, last_tokens, last_retries = time.monotonic(), 0, 0
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            rate = (self.generated_tokens - last_tokens) / (now - last_time)
            self.metrics["rollout/generated_tokens_per_s"].append(rate)
            self.metrics["rollout/concurrency"].append(self.admission.inflight_rollouts)
            self.metrics["rollout/concurrency_cap"].append(self.flow.concurrency.cap)
            self.metrics["rollout/score_queue_size"].append(self.score_queue.qsize())
            if self.flow.pacer is not None:
                self.metrics["rollout/staleness_cap"].append(self.flow.pacer.cap)
            retries = self.loop.client.retry_count
            self.metrics["rollout/vllm_retry_count"].append(retries - last_retries)
            last_time, last_tokens, last_retries = now, self.generated_tokens, retries
            self._flush_metrics()

    async def _watch_parent(self) -> None:
        while True:
            if os.getppid() != self.spec.parent_pid:
                os._exit(3)  # the trainer died without stopping us: never outlive it
            await asyncio.sleep(0.5)


def worker_entry(channels: WorkerChannels, parent_pid: int) -> None:
    """Process entry: import what the rollouts run, wait for the spec, run. Without a spec it ends when the
    trainer sets the stop event or dies."""
    import transformers  # noqa: F401 - the tokenizer and the loop need it: import it before the spec comes

    import asyncrl.client  # noqa: F401
    import asyncrl.rollout.loop  # noqa: F401

    while True:
        try:
            spec = channels.spec_queue.get(timeout=0.2)
            break
        except queue.Empty:
            if channels.stop_event.is_set() or os.getppid() != parent_pid:
                return
    worker_main(spec, channels)


def worker_main(spec: WorkerSpec, channels: WorkerChannels) -> None:
    """Process entry: run the driver; on failure hand the trainer its one-line summary and the traceback."""
    try:
        asyncio.run(_amain(spec, channels))
    except BaseException as exc:
        channels.exception_queue.put((failure_line(exc), traceback.format_exc()))
        channels.failed_event.set()


def failure_line(exc: BaseException) -> str:
    """The first error inside the task groups, as one line: a reward's error says everything itself."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    if isinstance(exc, RewardFunctionError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


async def _amain(spec: WorkerSpec, channels: WorkerChannels) -> None:
    from asyncrl.client import GenerationClient

    config = spec.config
    async with GenerationClient(spec.base_url, spec.model_name, timeout_s=config.server.timeout) as client:
        loop = spec.loop_cls(config, spec.tokenizer, client, spec.advantage_fn, spec.max_model_len,
                             seed_offset=spec.start_prompt_index * 1000)  # fmt: skip
        await WorkerDriver(spec, channels, loop).run()
