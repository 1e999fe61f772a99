"""The rollout worker process: prompt -> admit -> generate -> score -> queue.

Spawned by trainer rank 0 (``spawn_worker``, then ``send_spec``) with no GPU and no distributed variables;
``worker_entry`` waits for the spec and ``run_worker`` runs it. ``WorkerDriver.run`` is the whole path of a sample:

- prompt: the prompt stream in the recorded order (``prompts``); a filtered prompt is a ``PromptDone`` at once;
- admit: ``_admit`` waits until the worker's side of flow control (``WorkerFlow``: the token allowance, the
  smaller of the KV-load and staleness caps on rollouts in flight, room in the scoring queue) lets a group start;
- generate: ``_generate`` (a task per group) runs its rollouts and puts it in the scoring queue, or drops it (its
  prompt too long, or its requests failed after the client's retries);
- score: ``_score_loop`` takes the generated groups in the order they finished, rollout.score_concurrency at a time,
  and ``_score`` scores each and computes its advantages;
- queue: ``_queue`` sends the group's samples, or a ``PromptDone`` saying why it was dropped, to the trainer.

The worker wakes on events: a finished rollout or group sets ``changed``, the trainer's stop request (a thread
blocked on the control queue) sets ``stopping``. The trainer's counters (allowance, tokens consumed, weight
version) are shared memory that signals nothing: ``_wait_for_change`` is the one place that polls them. Any other
exception reaches the trainer with its traceback; a dead parent ends the worker (parent.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.advantages import Estimator, group_drop_reason, silent_rewards
from asyncrl.client import ROLLOUT_MODEL, GenerationClient, ServerError, policy_model
from asyncrl.config.schema import Config
from asyncrl.data import PromptStream, epoch_rows
from asyncrl.flow import FlowControl
from asyncrl.parent import exit_with_parent
from asyncrl.rollout.admission import WorkerFlow
from asyncrl.rollout.channels import STOP, WorkerChannels
from asyncrl.rollout.concurrency import LoadPoller
from asyncrl.rollout.environments import Agents
from asyncrl.rollout.group_metrics import completion_records, group_metrics
from asyncrl.rollout.images import data_folder, place_row_images
from asyncrl.rollout.loop import AsyncRolloutLoop, PromptTooLong
from asyncrl.rollout.scoring import RewardFunctionError, RewardSource, score_group
from asyncrl.rollout.solved import RetireSolved, common_reward
from asyncrl.rollout.trainer_state import rollout_state
from asyncrl.rollout.types import EndOfBatch, PromptDone, Rollout, RolloutGroup, RolloutSample

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

POLL_S = 0.01
"""How often a waiting worker reads the trainer's counters, which change with no signal."""


def worker_entry(channels: WorkerChannels, parent_pid: int) -> None:
    """Process entry: import what the rollouts run while the trainer prepares the spec, then run it. Without a
    spec it ends when the trainer asks it to stop; it never outlives the trainer."""
    import transformers  # noqa: F401 - the tokenizer and the loop need it: import it before the spec comes

    exit_with_parent(parent_pid)
    spec = channels.control_queue.get()
    if isinstance(spec, WorkerSpec):  # not the stop request
        run_worker(spec, channels)


def run_worker(spec: WorkerSpec, channels: WorkerChannels) -> None:
    """Run the worker until its prompts end or the trainer stops it; a failure reaches the trainer as its one-line
    summary and traceback."""
    try:
        asyncio.run(WorkerDriver(spec, channels).run())
    except BaseException as exc:
        channels.report_failure(failure_line(exc), traceback.format_exc())


@dataclass
class WorkerSpec:
    """Everything the worker needs; pickled at spawn (checked beforehand by the trainer)."""

    config: Config
    tokenizer: PreTrainedTokenizerBase
    dataset: Dataset | Sequence[dict[str, Any]]
    """The prompt rows; a list of one empty row when environments supply the prompts (environment_rows)."""
    reward_sources: list[RewardSource]
    loop_cls: type[AsyncRolloutLoop]
    advantage_fn: Estimator
    base_urls: list[str]
    """Every generation server; each request goes to the least loaded (client.choose_server)."""
    model_name: str
    max_model_len: int
    flow: FlowControl
    """The run's flow rules (its plan's, asyncrl/plan/): the worker's side of them is ``WorkerFlow``."""
    adapter_prefix: str | None = None
    """Set under adapter-only LoRA sync: each policy version is served as its own adapter (client.policy_model)."""
    start_prompt_index: int = 0
    skip_prompt_indices: frozenset[int] = frozenset()
    """Prompts past start_prompt_index that the checkpoint resumed from had already consumed."""
    total_prompts: int | None = None
    """Stop after this global prompt index (epoch-based runs); None = cycle epochs until stopped."""


@dataclass(frozen=True)
class Prompt:
    """One position of the prompt stream: its global index, dataset row and epoch."""

    index: int
    row_index: int
    row: dict[str, Any]
    epoch: int
    ends_epoch: bool


def prompts(spec: WorkerSpec) -> Iterator[Prompt]:
    """The prompt stream from ``spec.start_prompt_index``, epoch after epoch in each epoch's recorded order, to
    ``spec.total_prompts`` (or for ever); a streamed split (data.streaming) in its passes' order, for ever. A row's
    images (its image column) are placed in its prompt (rollout/images.py)."""
    folder = data_folder(spec.config.data.path)
    if isinstance(spec.dataset, PromptStream):
        for index, position, row, epoch, last in spec.dataset.prompts_from(spec.start_prompt_index):
            yield Prompt(index, position, place_row_images(row, folder), epoch, ends_epoch=last)
        return
    n_rows = len(spec.dataset)
    index, order_epoch, order = spec.start_prompt_index, -1, np.arange(0)
    while spec.total_prompts is None or index < spec.total_prompts:
        epoch, position = divmod(index, n_rows)
        if epoch != order_epoch:
            order_epoch, order = epoch, prompt_order(n_rows, epoch, spec.config.trainer.seed, spec.config.data.shuffle)
        row_index = int(order[position])
        row = place_row_images(spec.dataset[row_index], folder)
        yield Prompt(index, row_index, row, epoch, ends_epoch=position == n_rows - 1)
        index += 1


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
    """The trainer asked the worker to stop: it ends now, rollouts in flight included."""


class WorkerDriver:
    def __init__(self, spec: WorkerSpec, channels: WorkerChannels) -> None:
        self.spec, self.channels, self.config = spec, channels, spec.config
        self.flow = WorkerFlow(spec.flow)
        self.admission = self.flow.admission
        self.inflight_versions: Counter[int] = Counter()
        """Groups generating, by the policy version they started under."""
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.generation_spans: list[tuple[float, float]] = []
        self.completion_records: list[dict[str, Any]] = []
        self.generated_tokens = 0
        self.group_ids = iter(range(10**12))
        self.score_queue: asyncio.Queue[ScoreJob] = asyncio.Queue(self.config.rollout.score_queue_maxsize)
        self.changed = asyncio.Event()
        """Set when a rollout or group of this worker ends, or the scorer takes a group: admission may move."""
        self.stopping = asyncio.Event()
        """Set when the trainer's stop request arrives (``_listen_for_stop``)."""
        self.retire = RetireSolved(self.config.data.retire_solved_after)

    async def run(self) -> None:
        """prompt -> admit -> generate -> score -> queue, until the prompts end or the trainer stops the worker."""
        async with self._running() as tasks:
            accepted, retired, solved = 0, 0, ""
            for prompt in prompts(self.spec):
                if prompt.index in self.spec.skip_prompt_indices:
                    accepted += 1  # trained before the checkpoint this run resumed from
                elif self.retire.retired(prompt.row_index):
                    retired += 1
                    self.metrics["rollout/retired_prompt_count"].append(1.0)
                    self.channels.send(PromptDone(prompt.index, "retired"))
                elif not self.loop.filter_prompt(prompt.row_index, prompt.row, prompt.epoch):
                    self.channels.send(PromptDone(prompt.index, "filtered"))
                else:
                    accepted += 1
                    await self._admit()
                    self.admission.on_group_start()
                    tasks.create_task(self._generate(prompt))
                if prompt.ends_epoch:
                    if not accepted and retired:
                        solved = self._all_retired(prompt.epoch)
                        break
                    if not accepted:
                        raise RuntimeError(f"filter_prompt rejected every prompt of epoch {prompt.epoch}: no batch "
                                           "can be trained")  # fmt: skip
                    accepted = retired = 0
            await self._wait_idle()
            self.channels.send(EndOfBatch(self.channels.model_version, solved))
            self.channels.beat("all prompts generated; waiting for the trainer to stop")

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[asyncio.TaskGroup]:
        """What the main loop runs beside, for as long as it runs: the rollout loop and its client, the tool
        threads, the load poller, the scorer, the stop listener and the periodic metrics. A stop request cancels
        the main loop and every group in flight wherever they wait, and ends the worker without an error."""
        tool_pool = ThreadPoolExecutor(self.config.staleness.max_concurrent_rollouts, thread_name_prefix="tool")
        spec = self.spec
        try:
            timeout_s = self.config.server.timeout
            async with GenerationClient(spec.base_urls, spec.model_name, timeout_s=timeout_s,
                                        group_requests=self.config.rollout.group_requests) as client:  # fmt: skip
                self.loop = spec.loop_cls(self.config, spec.tokenizer, client, spec.advantage_fn, spec.max_model_len,
                                          seed_offset=spec.start_prompt_index * 1000)  # fmt: skip
                self.loop.tool_pool = tool_pool
                self.agents = Agents.from_config(self.config, tool_pool)
                self.admission.rollout_token_bound = self.loop.max_rollout_tokens(self.agents.enabled)
                await self.loop.setup()
                poller = LoadPoller(client.servers, self.flow.concurrency, self.flow.rollout_counts, self.metrics)
                try:
                    await poller.start(spec.max_model_len)
                    async with asyncio.TaskGroup() as tasks:
                        background = [
                            asyncio.create_task(self._report()),
                            asyncio.create_task(poller.run()),
                            tasks.create_task(self._watch_stop()),
                            tasks.create_task(self._score_loop(tasks)),
                        ]
                        threading.Thread(target=self._listen_for_stop, args=(asyncio.get_running_loop(),),
                                         name="asyncrl-stop", daemon=True).start()  # fmt: skip
                        try:
                            yield tasks
                        finally:
                            for task in background:
                                task.cancel()
                except* StopRequested:
                    # nobody reads the queues any more: exiting must not wait for their buffered items to be flushed
                    self.channels.abandon()
                finally:
                    await poller.aclose()
                    await self.loop.close()
                    self._flush_metrics()
        finally:
            tool_pool.shutdown(wait=False, cancel_futures=True)

    def _listen_for_stop(self, loop: asyncio.AbstractEventLoop) -> None:
        """A thread: block on the control queue until the trainer's stop request comes, then wake the driver."""
        while self.channels.control_queue.get() != STOP:
            pass
        with contextlib.suppress(RuntimeError):  # the event loop ended first: nothing left to stop
            loop.call_soon_threadsafe(self.stopping.set)

    async def _watch_stop(self) -> None:
        """Raise StopRequested once the trainer asks: the task group then cancels the main loop and every group
        in flight, wherever they wait (admission backpressure waits for as long as nobody trains)."""
        await self.stopping.wait()
        raise StopRequested

    def _all_retired(self, epoch: int) -> str:
        """The prompts end: every one of ``epoch`` was retired (or filtered). The line the trainer ends with."""
        after = self.config.data.retire_solved_after
        return (f"the task is solved for this model: every prompt of epoch {epoch} is retired, its last {after} "
                f"group(s) scored {self.retire.rewards.highest:g} for every rollout, the highest reward of the run "
                f"(data.retire_solved_after={after}); training ends here")  # fmt: skip

    # ---- admit -----------------------------------------------------------------------------------------------

    async def _admit(self) -> None:
        """Wait until a new group may start; in synchronous mode close the batch at the allowance."""
        waited_since: float | None = None
        while True:
            reason = self.flow.wait_reason(self.channels.token_allowance, self.channels.tokens_consumed,
                                           self.score_queue.full())  # fmt: skip
            if reason is None:
                break
            waited_since = waited_since or self.flow.clock()
            if self.flow.closes_batch(reason):
                await self._end_sync_batch()
                continue
            self.channels.beat(f"admission: {reason} ({self.admission.inflight_rollouts} rollouts in flight)")
            await self._wait_for_change(POLL_S)
        if waited_since is not None:
            self.metrics["rollout/backpressure_s"].append(self.flow.clock() - waited_since)

    async def _wait_for_change(self, poll_s: float | None) -> None:
        """Until a rollout or group of this worker ends or the scorer takes a group, or at most ``poll_s``: the
        trainer's counters change with no signal, so a wait on them reads them again after that long. Not
        ``wait_for``: on Python 3.11 it swallows a stop's cancellation that comes with the wake-up, and the main
        loop would then start a group on a task group that is shutting down (a coroutine never awaited)."""
        self.changed.clear()  # set before this wait: already taken into account by the caller's check
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(poll_s):
                await self.changed.wait()

    async def _end_sync_batch(self) -> None:
        """max_staleness=0: finish in-flight groups, mark the batch, wait for the trainer's weight sync."""
        await self._wait_idle()
        if self.flow.batch_has_room(self.channels.token_allowance):
            return  # dropped groups left room: generate more under the same weights
        version = self.channels.model_version
        self.channels.send(EndOfBatch(version))
        while self.channels.model_version == version and not self.stopping.is_set():
            self.channels.beat(f"synchronous mode: waiting for weight sync to version {version + 1}")
            await self._wait_for_change(POLL_S)
        self.flow.start_batch()

    async def _wait_idle(self) -> None:
        while self.admission.inflight_groups > 0:
            self.channels.beat(f"waiting for {self.admission.inflight_rollouts} rollouts in flight")
            await self._wait_for_change(None)

    # ---- generate --------------------------------------------------------------------------------------------

    async def _generate(self, prompt: Prompt) -> None:
        """Generate the group and queue it for scoring (``_score_loop`` sends its samples), or drop it here."""
        version = self.channels.model_version
        self._generating(version, +1)
        started = time.time()
        ROLLOUT_MODEL.set(policy_model(self.spec.model_name, self.spec.adapter_prefix, version))  # this task only
        group_id = next(self.group_ids)
        outcomes = await asyncio.gather(*(self._one_rollout(prompt.row, group_id)
                                          for _ in range(self.config.sampling.num_generations)),
                                        return_exceptions=True)  # fmt: skip
        rollouts = [r for r in outcomes if isinstance(r, Rollout)]
        if len(rollouts) < len(outcomes):
            self.agents.release(r.env for r in rollouts)
            errors = [e for e in outcomes if not isinstance(e, Rollout)]
            self._drop_ungenerated(prompt.index, version, rollouts, errors)
            return
        group = self.loop.build_group(prompt.row.get("prompt") or [], prompt.row, rollouts, group_id=group_id,
                                      row_index=prompt.row_index, model_version=version)  # fmt: skip
        self.generation_spans.append((started, time.time()))
        blocked = time.monotonic()
        job = ScoreJob(group, prompt.index, prompt.epoch, version, sum(map(rollout_tokens, rollouts)))
        await self.score_queue.put(job)
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
        self.changed.set()
        self.channels.send(PromptDone(prompt_index, reason, detail=str(error)[:500]))
        self._generating(version, -1)
        self.channels.beat(f"group dropped: {reason}")

    # ---- score and queue -------------------------------------------------------------------------------------

    async def _score_loop(self, tasks: asyncio.TaskGroup) -> None:
        """Score the generated groups in the order their generation finished, rollout.score_concurrency at a time:
        near convergence a step scores hundreds of groups, and a slow reward function (a sandbox, a judge over HTTP)
        or a busy event loop would otherwise bound the run at one group's latency each. A group is taken from the
        queue only once a slot is free, so a full queue still holds generation back."""
        slots = asyncio.Semaphore(self.config.rollout.score_concurrency)
        while True:
            await slots.acquire()
            job = await self.score_queue.get()
            self.changed.set()  # room in the scoring queue
            self.metrics["rollout/score_wait_s"].append(time.monotonic() - job.group.queued_at)
            tasks.create_task(self._score_in_slot(job, slots))

    async def _score_in_slot(self, job: ScoreJob, slots: asyncio.Semaphore) -> None:
        try:
            await self._score(job)
        finally:
            slots.release()

    async def _score(self, job: ScoreJob) -> None:
        """Score the group, compute its advantages, feed its lag to the pacer, and queue it."""
        group = job.group
        started = time.monotonic()
        rows = epoch_rows(self.spec.dataset)
        state = functools.partial(rollout_state, self.config, job.version, job.prompt_index, rows)
        try:
            per_source = await score_group(group, self.spec.reward_sources, state)
        finally:
            self.agents.release(r.env for r in group.rollouts)
        self.metrics["rollout/score_s"].append(time.monotonic() - started)
        advantages = np.asarray(self.loop.compute_advantages(group), dtype=np.float64)
        drop = group_drop_reason(group.rewards)
        self.retire.on_group(group.row_index, group.rewards)
        self._record_group(group, per_source, drop, advantages)
        self._pace(job.version)
        self._queue(job, per_source, advantages, drop)

    def _queue(self, job: ScoreJob, per_source: dict[str, np.ndarray], advantages: np.ndarray,
               drop: str | None) -> None:  # fmt: skip
        """Send the group's samples to the trainer, or a PromptDone saying why it was dropped."""
        if drop is not None:
            self.admission.on_group_done(0, job.generated)
            common = common_reward(job.group.rewards) if drop == "zero_std" else None
            self.channels.send(PromptDone(job.prompt_index, drop, *silent_rewards(per_source), reward=common))
        else:
            samples = build_samples(job.group, advantages, per_source, job.prompt_index, job.epoch)
            self.admission.on_group_done(sum(s.num_tokens for s in samples), job.generated)
            self._flush_metrics()  # the group's scoring metrics reach the trainer no later than its samples
            for sample in samples:
                self.channels.send(sample)
        self.changed.set()
        self._generating(job.version, -1)  # after its samples are sent (and counted): the trainer drains them
        self.channels.beat("group queued")

    def _pace(self, start_version: int) -> None:
        """Feed the group's lag to the staleness pacer, before its samples join the queue."""
        late = self.flow.on_group_queued(start_version, self.channels.model_version)
        if late is not None:
            self.metrics["rollout/late_group_count"].append(float(late))

    async def _one_rollout(self, row: dict[str, Any], group_id: int) -> Rollout:
        started = time.monotonic()
        episode = None
        try:
            episode = await self.agents.begin(row)
            rollout = await self.loop.generate_one(episode.prompt, episode.tools, group_id)
            rollout.env = episode.env
            rollout.env_reward, reward_s = await self.agents.end(episode)
        except BaseException:
            self.agents.release([episode.env] if episode is not None else [])
            self.admission.on_rollout_failed()
            self.changed.set()
            raise
        for name, seconds in (("env/reset_s", episode.reset_s), ("env/reward_s", reward_s)):
            if seconds is not None:
                self.metrics[name].append(seconds)
        self.metrics["rollout/duration_s"].append(time.monotonic() - started)
        self.generated_tokens += sum(len(t.output_ids) for t in rollout.turns)
        self.admission.on_rollout_done(rollout_tokens(rollout))
        self.changed.set()
        self.channels.beat("rollout done")
        return rollout

    def _record_group(
        self, group: RolloutGroup, per_source: dict[str, np.ndarray], drop: str | None, advantages: np.ndarray
    ) -> None:
        for name, values in group_metrics(group, per_source, drop).items():
            self.metrics[name].extend(values)
        if self.config.logging.log_completions:
            self.completion_records.extend(completion_records(group, advantages, self.config.logging.log_multimodal))

    # ---- plumbing --------------------------------------------------------------------------------------------

    def _flush_metrics(self) -> None:
        if self.metrics or self.generation_spans or self.completion_records:
            self.channels.metrics_queue.put({**self.metrics, "timeline": {"generation": self.generation_spans},
                                             "completions": self.completion_records})  # fmt: skip
            self.metrics.clear()  # in place: the load poller holds this dict
            self.generation_spans, self.completion_records = [], []

    async def _report(self, interval_s: float = 1.0) -> None:
        """Every ``interval_s``: the rate and load metrics, flushed to the trainer, and a heartbeat (a wait on an
        event, such as a long rollout, sends none itself). ``rollout/worker_cpu`` is the share of a core this process
        used: near 1, its one event loop (requests, rendering, scoring) bounds generation, whatever the server's
        speed."""
        last_time, last_tokens, last_retries, last_cpu = time.monotonic(), 0, 0, time.process_time()
        last_requests = [0] * len(self.loop.client.servers)
        while True:
            await asyncio.sleep(interval_s)
            self.channels.beat()
            now, cpu = time.monotonic(), time.process_time()
            rate = (self.generated_tokens - last_tokens) / (now - last_time)
            self.metrics["rollout/generated_tokens_per_s"].append(rate)
            self.metrics["rollout/worker_cpu"].append((cpu - last_cpu) / (now - last_time))
            self.metrics["rollout/concurrency"].append(self.admission.inflight_rollouts)
            self.metrics["rollout/concurrency_cap"].append(self.flow.concurrency.cap)
            self.metrics["rollout/score_queue_size"].append(self.score_queue.qsize())
            if self.flow.pacer is not None:
                self.metrics["rollout/staleness_cap"].append(self.flow.pacer.cap)
            retries = self.loop.client.retry_count
            self.metrics["rollout/vllm_retry_count"].append(retries - last_retries)
            last_time, last_tokens, last_retries, last_cpu = now, self.generated_tokens, retries, cpu
            last_requests = self._record_server_requests(last_requests)
            self._flush_metrics()

    def _record_server_requests(self, last: list[int]) -> list[int]:
        """With several servers, the requests each was sent since ``last`` (rollout/server_{i}_request_count, in
        the order of server.replicas' ports or server.base_urls); the counts now."""
        servers = self.loop.client.servers
        if len(servers) > 1:
            for index, (server, before) in enumerate(zip(servers, last, strict=True)):
                self.metrics[f"rollout/server_{index}_request_count"].append(server.requests - before)
        return [server.requests for server in servers]


def build_samples(
    group: RolloutGroup, advantages: np.ndarray, per_source: dict[str, np.ndarray], prompt_index: int,
    epoch: int,
) -> list[RolloutSample]:  # fmt: skip
    """One sample per rollout sequence, with its rollout's advantage and reward and the group's spread."""
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


def failure_line(exc: BaseException) -> str:
    """The first error inside the task groups, as one line: a reward's error says everything itself."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    if isinstance(exc, RewardFunctionError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
