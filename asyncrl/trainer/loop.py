"""The training loop: pull -> plan -> step -> sync -> checkpoint, with the rollout worker running beside it.

`Trainer.train` reads top to bottom as the spec's loop. Rank-0-only parts (worker, weight sync, logging,
checkpoints) are isolated in their own methods. The Trainer is rank 0 of the trainer's ranks, a world of one
when the run has one process: at each collective point (a step's rows, a weight sync, a checkpoint) it commands
the other ranks (trainer/distributed.py), and every world size runs the same sharded model, step and checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from asyncrl.client import policy_model
from asyncrl.config.schema import Config
from asyncrl.control_group import ControlGroup
from asyncrl.data import epoch_rows
from asyncrl.dtypes import torch_dtype
from asyncrl.evaluate import EvalRecord, evaluate
from asyncrl.footprint import GIB, TrainerMemory
from asyncrl.lora import is_peft
from asyncrl.losses.step import StepLoss, StepTotals
from asyncrl.metrics import JsonlSink, MetricWindow
from asyncrl.packing.attention import unwrap_model
from asyncrl.rewards.endpoint import serving_reward_models
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.solved import RewardRange
from asyncrl.rollout.spawn import send_spec, spawn_worker
from asyncrl.rollout.worker import WorkerSpec
from asyncrl.serving.command import served_model_name
from asyncrl.serving.handle import check_alive
from asyncrl.serving.watchdog import ServerWatch
from asyncrl.trackers import build_trackers
from asyncrl.trainer.assembler import PromptProgress, RolloutWorkerError, Step, StepAssembler
from asyncrl.trainer.autotune import config_dir, watch
from asyncrl.trainer.callbacks import Callbacks
from asyncrl.trainer.checkpoint import (
    TrainerState,
    load_checkpoint,
    publish,
    save_checkpoint,
    save_processor_files,
    source_processor_files,
)
from asyncrl.trainer.completions_hub import start_completions_hub
from asyncrl.trainer.console import Console
from asyncrl.trainer.distributed import (
    PassResult,
    build_sharded,
    load_grad_scaler,
    split_rows,
    train_step,
    warm_up_step,
)
from asyncrl.trainer.exits import restart_count
from asyncrl.trainer.flops import mfu_meter
from asyncrl.trainer.forward import report_last_row, resolve_compile
from asyncrl.trainer.fsdp import GatheredModel, save_weights
from asyncrl.trainer.group_watch import GenerationFailingError, GroupWatch, TaskSolved, TrainingStalledError
from asyncrl.trainer.memory import TrainerOutOfMemoryError, measure, out_of_memory_line
from asyncrl.trainer.model import build_grad_scaler, use_cpu_threads
from asyncrl.trainer.moe import router_aux_coef
from asyncrl.trainer.profiler import phase, profiled_step
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.reference import build_reference
from asyncrl.trainer.setup import Prepared
from asyncrl.trainer.step_metrics import batch_metrics, perf_metrics, sample_events
from asyncrl.trainer.timeline import Timeline
from asyncrl.trainer.weight_sync import WeightSyncError, build_weight_sync

log = logging.getLogger("asyncrl.trainer")


STARTED_ENV = "ASYNCRL_STARTED_AT"
"""time.time() when `asyncrl train` started (its first job; a sweep's later job: its own start; launch.py sets it):
the origin of perf/startup_* and of the run's wall time."""
JOB_STARTED_ENV = "ASYNCRL_JOB_STARTED_AT"
"""time.time() when the job itself started, after the command's imports, composing and checks (perf/startup_job_s)."""


def run_training(config: Config, run_dir: Path, server: Any, prepared: Prepared, ranks: Ranks) -> None:
    """Train as rank 0 of ``ranks`` (trainer/distributed.py), the reward models of reward_funcs served beside it on its
    device (rewards/endpoint.py; loaded before the warm-up measures the trainer's memory). A CUDA out-of-memory error
    anywhere in it ends the run with one line saying what was measured and which keys change it (the traceback goes
    to the run's log)."""
    trainer = None
    try:
        with serving_reward_models(config, prepared.components.rewards):
            trainer = Trainer(config, run_dir, server, prepared, ranks)
            try:
                trainer.train()
            finally:
                trainer.close()
    except torch.OutOfMemoryError as error:
        memory = None if trainer is None else trainer.memory
        raise TrainerOutOfMemoryError(out_of_memory_line(config, memory, _server_share(server))) from error


def _server_share(server: Any) -> str | None:
    """The launched vLLM's --gpu-memory-utilization, for the out-of-memory line."""
    for handle in getattr(server, "servers", []):
        argv = getattr(getattr(handle, "server", handle), "argv", [])
        if "--gpu-memory-utilization" in argv:
            return f"--gpu-memory-utilization {argv[argv.index('--gpu-memory-utilization') + 1]}"
    return None


class Trainer:
    def __init__(self, config: Config, run_dir: Path, server: Any, prepared: Prepared, ranks: Ranks) -> None:
        self.config, self.run_dir, self.server, self.prepared = config, run_dir, server, prepared
        self.ranks, self.world = ranks, ranks.world
        self.started_at = float(os.environ.get(STARTED_ENV) or time.time())
        self.startup: dict[str, float] = {}  # perf/startup_*, reported with the first step
        self.memory: TrainerMemory | None = None
        use_cpu_threads(config, self.world, prepared.plan.server_backend)
        self.output_dir = Path(config.trainer.output_dir or run_dir)
        self.server_watch = ServerWatch(server, config.server.health_timeout)  # dead, or hung: silent on /health
        watch = partial(self.server_watch.check, "during a weight sync")  # while each call of a sync waits
        self.control = ControlGroup.connect(server.base_urls, timeout_s=config.server.timeout, watch=watch)
        self.flow = prepared.plan.flow
        self.channels = WorkerChannels.create(1)
        self.worker = spawn_worker(self.channels)  # it imports, and the model loads, while a launched server boots
        try:
            self._set_up()
        except BaseException:
            self._stop_worker()
            raise

    def _set_up(self) -> None:
        """Everything after the worker's spawn: the model (while a launched server boots), the server's limits,
        the loss, packing, logging, the weight-sync channel, the worker's spec and the first evaluation."""
        c = self.config
        self._launch_early()
        self.model, self.optimizer, self.scheduler, resume = build_sharded(c, self.run_dir, self.ranks)
        watch(config_dir(self.run_dir, self.ranks.rank))  # fla's kernels autotune once each, not once a row band
        self.scaler = build_grad_scaler(c)
        job_started = float(os.environ.get(JOB_STARTED_ENV) or self.started_at)
        self.startup["perf/startup_job_s"] = job_started - self.started_at
        self.startup["perf/startup_model_loaded_s"] = time.time() - self.started_at
        self.processor_files = source_processor_files(c, self.model.config)
        components = self.prepared.components
        self.loss = StepLoss(components.loss, components.advantage, c.sampling.max_completion_length)
        self.loss.router_aux_coef = router_aux_coef(c, self.model.config)
        self.reference = build_reference(c, self.model, components.loss.options)
        self.top_k = c.sampling.num_sampler_logprobs if "sampler_top_logprobs" in self.loss.requires else 0
        self.memory = self._warm_up()  # a vLLM waiting for the measured split starts in it
        self.server.ready()
        self._say_room()
        self.startup["perf/startup_server_healthy_s"] = time.time() - self.started_at
        self.max_model_len = self.control.max_model_len()
        self.state = TrainerState(step=0, model_version=0, prompt_index=0, prompts_consumed=0, extra={})
        if resume is not None:
            self.state = load_checkpoint(resume, self.scheduler)
            load_grad_scaler(self.scaler, self.state)
            log.info("resumed from %s at step %d, prompt %d", resume, self.state.step, self.state.prompt_index)
        self.loss.load_state_dict(self.state.extra.get("loss", {}))
        self.mfu, self.step_flops = mfu_meter(c, self.model.config, self.world), 0.0
        self.row_factory, self.token_budget = components.packer.rows(self.max_model_len)
        self.window, self.timeline = MetricWindow(), Timeline()
        self.sink = JsonlSink(self.run_dir / "metrics.jsonl")
        if resume is not None:
            self._drop_abandoned_rows()
        self.restarts = restart_count(self.run_dir)
        self.console = Console(c, self.flow, start_step=self.state.step)
        self.trackers = build_trackers(c, self.run_dir)
        self.completions_hub = start_completions_hub(c, self.run_dir)  # logging.log_completions_hub_repo
        self.callbacks = Callbacks(c)
        self.completions: list[dict[str, Any]] = []
        self.sync = build_weight_sync(self.prepared.plan, self.control, self.run_dir)
        self.sync.init(self._sync_view())
        if resume is not None:
            self._push(self.state.model_version)  # the server starts from the base weights
        self.last_evaluation: tuple[int, dict[str, float]] | None = None
        self._start_worker()  # the first groups generate beside the first evaluation
        self.evaluations = self._first_evaluation(resume is not None)

    # ---- the loop --------------------------------------------------------------------------------------------

    def train(self) -> None:
        self.run_started = time.time()
        while not self._finished():
            step_started = time.perf_counter()
            with profiled_step(self.state.step + 1, self.config.logging.profile_steps, self.run_dir / "profile"):
                with phase("rollout_wait"):
                    step = self._next_step()
                self.window.add("rollout/queue_size", _qsize(self.channels.rollout_queue) + self.assembler.held)
                if step is None or not step.rows:
                    break
                rows = self._optimize(step)
                self.state.step += 1
                if self.startup:
                    self._report_startup()
                if self.flow.grant_before_sync():
                    self._grant_allowance(step, rows)
                if self.state.step % self.config.staleness.weight_sync_steps == 0:
                    with phase("weight_sync"):
                        self._sync_weights()
                if not self.flow.grant_before_sync():
                    self._grant_allowance(step, rows)
            self._record_step_time(step, time.perf_counter() - step_started)
            self.callbacks.call("on_step_end", self.state)
            evaluated = self._evaluate_if_due()
            if self.state.step % self.config.trainer.logging_steps == 0 or evaluated:
                self._log()
            if self._should_save():
                self._save()
            if step.final:
                break
        if self.callbacks.stopped_by is not None:
            self.console.note(f"{escape(self.callbacks.stopped_by)} (trainer.callbacks) set "
                              f"control.should_training_stop at step {self.state.step}")  # fmt: skip
        if self.state.step % self.config.staleness.weight_sync_steps != 0:
            self._sync_weights()  # the server, and the evaluation below, get the final weights
        if self.evaluations is not None:
            self._last_evaluation(self.evaluations)  # before the last checkpoint, which keeps it
        if self.config.trainer.save_strategy == "steps" and not self._should_save():
            self._save()  # the last step is always checkpointed
        self._save_final_model()
        if self.evaluations is not None:
            self.console.note(self.evaluations.summary(self._num_eval_prompts(), self.config.sampling.temperature))
        self.ranks.command("stop")

    def _next_step(self) -> Step | None:
        """The next step from the rollout queue; None when the task is solved (a line says so, and the run ends as
        any run does). A stall ends the run with its error, after saving what was trained (``_save_after_stall``)."""
        try:
            step = self.assembler.next_step(
                sync_follows=(self.state.step + 1) % self.config.staleness.weight_sync_steps == 0
            )
        except TaskSolved as solved:
            self.console.note(escape(str(solved)))
            return None
        except TrainingStalledError as stall:
            saved = self._save_after_stall(stall)
            if saved is None:
                raise
            raise type(stall)(f"{stall}; {saved}") from stall
        if self.assembler.solved:  # the worker's prompts ended: every one was retired (data.retire_solved_after)
            self.console.note(escape(self.assembler.solved))
        return step

    def _save_after_stall(self, stall: TrainingStalledError) -> str | None:
        """Save what the run trained before a stall ends it: a checkpoint (save_strategy=steps) and the model, as a
        finished run's; where, for the error line (which adds the command that resumes). None when nothing was
        trained, or when a generation failure will restart the run (trainer.max_restarts): it resumes from the
        checkpoint, and a model/ directory would mark a finished run."""
        if self.state.step == 0:
            return None
        if self.config.trainer.save_strategy == "steps" and not self._should_save():  # else saved at this step
            self._save()
        if isinstance(stall, GenerationFailingError) and self.config.trainer.max_restarts > 0:
            return None
        return f"the model of step {self.state.step} is saved in {self._write_final_model()}"

    def _report_startup(self) -> None:
        """Once, with the first step: seconds from the CLI's start to the model, the warm-up, the server's health
        and the first optimizer step (perf/startup_*), in the metrics and on the console."""
        self.startup["perf/startup_first_step_s"] = time.time() - self.started_at
        self.window.update(self.startup)
        parts = [f"{key.removeprefix('perf/startup_').removesuffix('_s').replace('_', ' ')} {value:.1f} s"
                 for key, value in self.startup.items()]  # fmt: skip
        self.console.note("startup (seconds since launch): " + ", ".join(parts))
        self.startup = {}

    def _warm_up(self) -> TrainerMemory | None:
        """On CUDA, one step on synthetic rows (one of the token budget, one short) whose update is thrown away, by
        every rank: its measured footprint decides the memory a vLLM on the same GPU gets (trainer/memory.py), and
        the compiled layers compile in it. A vLLM waiting for the figure is launched as soon as it is recorded. The
        figure known beforehand is the plan's measured stage (a restart's) or this shape's from an earlier run."""
        from asyncrl.footprint import cached_memory
        from asyncrl.trainer.memory import WARM_UP_PROMPT_TOKENS, synthetic_rows

        c = self.config
        if not (c.trainer.warm_up and torch.cuda.is_available()):
            return None
        started = time.time()
        text = unwrap_model(self.model).config.get_text_config()
        # the server's context before it answers: the plan's, else the built-in server's, its model's whole context
        max_model_len = self.prepared.plan.max_model_len or int(text.max_position_embeddings)
        row_factory, shape = self.prepared.components.packer.rows(max_model_len)
        completion = min(c.sampling.max_completion_length, max_model_len - 1)
        prompt = min(max_model_len - completion, WARM_UP_PROMPT_TOKENS)
        rows = synthetic_rows(row_factory, prompt, completion, c.sampling.num_generations, text.vocab_size, self.top_k)
        placement = [[index] * self.world for index in range(len(rows))]  # every rank runs every row
        mine = self.ranks.command("warm_up", split_rows(rows, placement, self.loss.norm(rows)))
        known = self.prepared.plan.trainer_memory or cached_memory(c, shape)

        def step(alone: bool, known: TrainerMemory | None) -> TrainerMemory:
            return measure(lambda: warm_up_step(self.model, self.loss, mine, self.ranks, c, self.reference), self.model,
                           self.optimizer, alone=alone, known=known)  # fmt: skip

        memory = self._measure_and_launch(step, shape, known, started)
        self.startup["perf/startup_warm_up_s"] = time.time() - started
        log.info("warm-up step (%d tokens, update thrown away) in %.1f s: %s", rows[0].num_forwarded,
                 time.time() - started, memory.describe())  # fmt: skip
        return memory

    def _say_room(self) -> None:
        """Once a vLLM on the trainer's GPU is up: what it took and what it left the trainer; a warning where the
        margin over the measured peak is gone (the first steps that outgrow the warm-up would run out of memory)."""
        from asyncrl.trainer.memory import room_line

        if self.memory is None or not self.server.shares_trainer_gpu:
            return
        free, _ = torch.cuda.mem_get_info()
        line, roomy = room_line(self.memory, int(free), int(torch.cuda.memory_reserved()), _server_share(self.server))
        if roomy:
            log.info(line)
        else:
            log.warning("%s: the margin is gone; give the server less with server.gpu_memory_utilization", line)

    def _compiles(self) -> bool:
        return resolve_compile(self.config.trainer.compile_layers, next(self.model.parameters()).device) is not None

    def _measure_and_launch(self, step: Any, shape: int, known: TrainerMemory | None, started: float) -> TrainerMemory:
        """The warm-up step(s) and a waiting vLLM's launch, in the order that starts vLLM soonest: at once on the
        figure known for this shape (its boot overlaps the whole warm-up), or on a room held for a warm-up that
        autotunes for minutes, else after the first measuring step."""
        if self.server.waits_for_warm_up and known is None:
            known = self._held_room()
            if known is not None:
                log.info("fla's kernels autotune in this first warm-up of the shape: %s; vLLM starts beside it on the "
                         "rest", known.describe())  # fmt: skip
        if known is not None and self.server.shares_trainer_gpu:  # launched already where known before the model
            if known.held:  # this run's, or the plan's when it restarts one
                from asyncrl.trainer.memory import hold

                hold(known)
            self._start_server(known)
            memory = step(alone=False, known=known)
            self._warn_if_outgrown(memory, known, "the room held before the warm-up" if known.held else
                                   "this shape's recorded figure")  # fmt: skip
            self._launch_with(memory, shape)  # the figure for the next run; the server is up already
            return memory
        if self.server.waits_for_warm_up and self._compiles():
            return self._measure_eagerly_then_compile(step, shape, started)
        memory = step(alone=self.server.waits_for_warm_up or known is None, known=known)
        self._launch_with(memory, shape)
        return memory

    def _launch_early(self) -> None:
        """A vLLM waiting for the trainer's footprint, launched before the model loads where the footprint is known
        already (a restart's plan, or this shape's recorded figure) and no room is to be held first: its boot
        overlaps the model's load too (launched at 37 s of a warm 2B start, 20 s after the job: RESULTS.md, session
        45). It profiles its memory about a minute after its launch, by when the load and a warm warm-up are done."""
        from asyncrl.footprint import cached_memory

        c, plan = self.config, self.prepared.plan
        if not (
            self.server.waits_for_warm_up and c.trainer.warm_up and plan.max_model_len and torch.cuda.is_available()
        ):
            return
        _, shape = self.prepared.components.packer.rows(plan.max_model_len)  # the warm-up's shape, as _warm_up finds it
        known = plan.trainer_memory or cached_memory(c, shape)
        if known is not None and not known.held:
            self._start_server(known)

    def _held_room(self) -> TrainerMemory | None:
        """A room for the trainer to hold while vLLM boots beside its warm-up (trainer/memory.py::held_room), where
        that warm-up autotunes fla's gated-DeltaNet kernels; nothing else uses the GPU yet."""
        from asyncrl.packing.deltanet import deltanet_layers, fla_unusable
        from asyncrl.trainer.memory import held_room

        model = unwrap_model(self.model)
        if not deltanet_layers(model) or fla_unusable() is not None:
            return None
        free, total = torch.cuda.mem_get_info()
        reserved = int(torch.cuda.memory_reserved())
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        static = int(torch.cuda.memory_allocated()) + 3 * trainable  # weights, then gradients and two moments
        return held_room(int(total), max(int(total - free) - reserved, 0), static)

    def _launch_with(self, memory: TrainerMemory, shape: int) -> None:
        """Record the figure for the next run of this shape, then launch the servers that waited, on it."""
        from asyncrl.footprint import record_memory

        record_memory(self.config, shape, memory)
        self._start_server(memory)

    def _start_server(self, memory: TrainerMemory) -> None:
        """Launch the servers that waited for the trainer's footprint, and when (perf/startup_server_launched_s)."""
        if self.server.waits_for_warm_up:
            self.startup["perf/startup_server_launched_s"] = time.time() - self.started_at
        self.server.start(memory)

    def _measure_eagerly_then_compile(self, step: Any, shape: int, started: float) -> TrainerMemory:
        """The footprint from an eager step (seconds; compiling the layers takes minutes at 2B), vLLM's launch with
        the share it leaves, then the compiling step while vLLM boots. Its footprint is said where it outgrows the
        eager one's with its margin, and is the one kept for the next run of the shape: the steps that follow are
        compiled (Gemma-3-270M's compiled step peaked at 16.9 GiB against the eager one's 13.0, and the next run's
        vLLM, launched on 13.0, left the trainer no margin)."""
        from asyncrl.footprint import record_memory

        with torch.compiler.set_stance("force_eager"):
            memory = step(alone=True, known=None)
        log.info("eager warm-up step in %.1f s: %s; vLLM starts now, the layers compile while it boots",
                 time.time() - started, memory.describe())  # fmt: skip
        self._launch_with(memory, shape)
        compiled = step(alone=False, known=memory)
        self._warn_if_outgrown(compiled, memory, "the eager step's figure")
        record_memory(self.config, shape, compiled)
        return compiled

    @staticmethod
    def _warn_if_outgrown(measured: TrainerMemory, launched_on: TrainerMemory, what: str) -> None:
        """vLLM's share was set from ``launched_on``: say so where this warm-up outgrew it with its margin."""
        if measured.footprint_bytes > launched_on.need_bytes:
            log.warning("the warm-up step takes %.1f GiB, more than the %.1f GiB (margin included) %s left the "
                        "trainer beside vLLM", measured.footprint_bytes / GIB, launched_on.need_bytes / GIB,
                        what)  # fmt: skip

    def _finished(self) -> bool:
        t = self.config.trainer
        if self.callbacks.control.should_training_stop:
            return True
        if t.max_steps > 0:
            return self.state.step >= t.max_steps
        total = self.prepared.total_prompts(self.config)
        return total is not None and self.progress.cursor >= total

    def _optimize(self, step: Step) -> list[Any]:
        """The step's optimizer passes (trainer.num_iterations), each micro-batch's row r on rank r: the loss of
        each row is its share of the step's, so the gradients add up to the step's."""
        rows = [row.pack(self.top_k) for row in step.rows]
        self.model.train()
        started = time.time()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        work = split_rows(rows, step.placement, self.loss.norm(rows))  # the step's norm, decided here once
        mine = self.ranks.command("step", work)
        self.step_flops = self.mfu.flops(rows) if self.mfu is not None else 0.0
        passes = train_step(self.model, self.optimizer, self.scheduler, self.loss, mine, self.ranks, self.config,
                            self.reference, self.scaler)  # fmt: skip
        for one in passes:
            self._record_pass(one, rows, step)
        if torch.cuda.is_available():
            self.window.add("perf/trainer_peak_memory_gib", torch.cuda.max_memory_reserved() / GIB)
        self.timeline.add("training", started, time.time())
        self.window.add("learning_rate", self.scheduler.get_last_lr()[0])
        self.window.update(batch_metrics(step, rows, self.token_budget))
        self.window.extend(sample_events(step))
        self.num_tokens += sum(r.num_forwarded for r in rows)
        return rows

    def _record_pass(self, one: PassResult, rows: list[Any], step: Step) -> None:
        """One optimizer pass's metrics: every rank's per-row loss metrics and the step loss (the entropy
        coefficient moves with each pass), its gradient norm and its compute (perf/* are per pass)."""
        self.window.update(self.loss.end_step(sum((totals for _, totals in one.gathered), StepTotals())))
        for metrics in (m for rank_metrics, _ in one.gathered for m in rank_metrics):
            self.window.add("entropy", metrics.pop("entropy"))
            self.window.update(metrics)
        self.window.add("grad_norm", one.grad_norm)
        self.window.update(perf_metrics(rows, one.rows.forward_s, one.rows.forward_backward_s, one.optimizer_s,
                                        step.wait_s, self.mfu, self.step_flops))  # fmt: skip

    def _record_step_time(self, step: Step, seconds: float) -> None:
        tokens = sum(s.num_tokens for s in step.samples)
        trained = sum(s.num_trained for s in step.samples)
        self.window.add("perf/step_s", seconds)
        self.window.add("perf/wall_clock_forwarded_tokens_per_s", tokens / max(seconds, 1e-9))
        self.window.add("perf/wall_clock_trained_tokens_per_s", trained / max(seconds, 1e-9))
        if self.mfu is not None:
            self.window.add("perf/wall_clock_mfu", self.mfu.mfu(self.step_flops, seconds))

    def _grant_allowance(self, step: Step, rows: list[Any]) -> None:
        """Let the worker hold the tokens of the next steps, measured on this one (``FlowControl.allowance``)."""
        consumed, forwarded = sum(s.num_tokens for s in step.samples), sum(r.num_forwarded for r in rows)
        self.channels.token_allowance = self.flow.allowance(consumed, forwarded, self.rows_per_step,
                                                                  self.token_budget)  # fmt: skip

    def _sync_weights(self) -> None:
        version = self.state.model_version + 1
        self.window.update(self._push(version))
        self.state.model_version = version
        self.channels.model_version = version

    def _push(self, version: int) -> dict[str, float]:
        """One weight sync; a failed one caused by the server's death says so, with the end of its log."""
        try:
            return self._push_weights(version)
        except WeightSyncError:
            check_alive(self.server)
            raise

    def _sync_view(self) -> GatheredModel:
        """What a sync sends: the adapter alone for an adapter sync; else every weight, gathered in the serving
        dtype (in float32 under LoRA, which casts after merging). Building it gathers nothing."""
        adapter_only = self.sync.adapter_only
        dtype = None if is_peft(self.model) and not adapter_only else torch_dtype(self.prepared.plan.serving_dtype)
        return GatheredModel(self.model, self.ranks, dtype, trainable_only=adapter_only)

    def _push_weights(self, version: int) -> dict[str, float]:
        """One weight sync: every parameter the transport reads is gathered by all ranks as it reads it (an
        adapter sync's view gathers the adapter alone; a merged one gathers in float32 and casts after merging)."""
        view = self._sync_view()
        self.ranks.command("sync", [(view.dtype, view.trainable_only)] * self.world)
        metrics = self.sync.push(view, version)
        view.done()  # not after a failure: rank 0 may have stopped between two collectives, and the run ends
        return metrics

    # ---- rank-0 services -------------------------------------------------------------------------------------

    def _start_worker(self) -> None:
        c, components = self.config, self.prepared.components
        self.progress = PromptProgress(cursor=self.state.prompt_index, done=set(self.state.done_after_index),
                                       consumed=self.state.prompts_consumed)  # fmt: skip
        self.num_tokens = int(self.state.extra.get("num_tokens", 0))
        self.rows_per_step = c.trainer.gradient_accumulation_steps * self.world
        self.channels.token_allowance = self.flow.initial_allowance(self.rows_per_step, self.token_budget)
        self.channels.model_version = self.state.model_version
        spec = WorkerSpec(
            config=c, tokenizer=self.prepared.tokenizer, dataset=self.prepared.dataset,
            reward_sources=components.rewards, advantage_fn=components.advantage, loop_cls=self.prepared.loop_cls,
            base_urls=self.server.base_urls,
            model_name=served_model_name(c), max_model_len=self.max_model_len, flow=self.flow,
            adapter_prefix=self.sync.adapter_prefix,
            start_prompt_index=self.state.prompt_index, total_prompts=self.prepared.total_prompts(c),
            skip_prompt_indices=frozenset(self.state.done_after_index),
        )  # fmt: skip
        send_spec(spec, self.channels)
        self.assembler = StepAssembler(
            self.channels, self.row_factory, self.token_budget, c.trainer.gradient_accumulation_steps,
            self.flow, self.progress, self.window, self._check_processes,
            c.staleness.rollout_worker_timeout, dp=self.world,
            watch=GroupWatch(c.rollout.max_consecutive_dropped_groups, c.rollout.max_failed_group_fraction,
                             c.rollout.stop_when_solved, RewardRange.from_json(self.state.extra.get("reward_range"))),
            samples_per_step=c.trainer.samples_per_step,
        )  # fmt: skip

    def _check_processes(self) -> None:
        self.server_watch.check("while the trainer waited for rollouts")
        self.sync.check()  # a failed resume leaves the server paused: say so instead of waiting for rollouts
        if not self.worker.is_alive() and self.channels.failure() is None:
            raise RolloutWorkerError(f"the rollout worker exited with code {self.worker.exitcode} without an error")

    def _log(self) -> None:
        self._drain_worker_metrics()
        metrics = self.window.reduce()
        metrics["num_tokens"] = self.num_tokens
        metrics["model_version"] = self.state.model_version
        metrics["perf/restarts"] = self.restarts
        rows = epoch_rows(self.prepared.dataset)
        if rows is not None:  # a streamed split's length is unknown here (its passes are read by the worker)
            metrics["epoch"] = self.progress.consumed / max(1, rows)
        metrics["time_s"] = time.time() - self.run_started
        self.sink.write(self.state.step, metrics)
        self.trackers.write(self.state.step, metrics)
        self.callbacks.call("on_log", self.state, logs=dict(metrics))
        self.console.log_step(self.state.step, metrics)
        if self.completions:
            self.console.log_completions(self.completions)
            self.trackers.write_completions(self.state.step, self.completions)
            if self.completions_hub is not None:
                self.completions_hub.write(self.state.step, self.completions)
            self.completions = []

    def _drain_worker_metrics(self) -> None:
        import queue

        while True:
            try:
                events = self.channels.metrics_queue.get_nowait()
            except queue.Empty:
                return
            self.completions.extend(events.pop("completions", []))
            for name, spans in events.pop("timeline", {}).items():
                for start, end in spans:
                    self.timeline.add(name, start, end)
            self.window.extend(events)

    # ---- held-out evaluation ----------------------------------------------------------------------------------

    def _evaluate(self) -> dict[str, float]:
        """Evaluate the weights the server holds, those of the current step (an evaluation comes after its sync).
        The trainer waits for it; the rollout worker does not, and generates beside it."""
        self.sync.settle()  # the server generates again after the last sync
        p = self.prepared
        model = policy_model(served_model_name(self.config), self.sync.adapter_prefix, self.state.model_version)
        with self.console.evaluating() as progress:
            results = evaluate(self.config, self.server.base_urls, model, p.tokenizer,
                               p.eval_dataset, p.components.rewards, self.max_model_len, progress)  # fmt: skip
        self.last_evaluation = (self.state.step, results)
        self.callbacks.call("on_evaluate", self.state, metrics=dict(results))
        return results

    def _first_evaluation(self, resumed: bool) -> EvalRecord | None:
        """The "before" evaluation: the base model's, or a resumed run's checkpoint's (the one saved with it when
        its step was evaluated, else evaluated now), labelled as such."""
        if self.prepared.eval_dataset is None:
            return None
        saved = self.state.extra.get("evaluation") if resumed else None  # a checkpoint's JSON, not a config
        if saved:
            self.last_evaluation = (self.state.step, saved)
        results = saved or self._evaluate()
        self.trackers.write(self.state.step, results)
        return EvalRecord(results, self.state.step, resumed=resumed)

    def _evaluate_if_due(self) -> bool:
        """Evaluate at logging.eval_steps and, with logging.eval_on_save, at checkpoint steps; eval/* then join the
        step's metrics (metrics.jsonl, trackers, the report's plots) and the console gets a line.

        Sharing the server: the evaluation runs on the trainer's thread right after the step's weight sync (these
        steps are multiples of staleness.weight_sync_steps), so the server holds exactly that step's weights and
        no sync can land mid-evaluation. The rollout worker keeps generating meanwhile: its requests and the
        evaluation's share the server's batches, and it stops only if it fills its token allowance
        (max_staleness steps of samples) before training resumes. Generation is thus slowed by the evaluation's
        share of the server, and never held back longer than the evaluation lasts; training waits for it, as it
        does for a checkpoint (perf/eval_s)."""
        lg, step = self.config.logging, self.state.step
        due = (bool(lg.eval_steps) and step % lg.eval_steps == 0) or (lg.eval_on_save and self._should_save())
        if self.evaluations is None or not due:
            return False
        started = time.perf_counter()
        results = self._evaluate()
        self.window.update(results)
        self.window.add("perf/eval_s", time.perf_counter() - started)
        scores = ", ".join(f"{key.removeprefix('eval/')} {value:.3f}" for key, value in sorted(results.items()))
        self.console.note(f"held-out evaluation at step {step}: {scores}")
        return True

    def _last_evaluation(self, record: EvalRecord) -> None:
        """The "after" evaluation: the last step's own if it was evaluated, else one now; eval.json."""
        import json

        step, results = self.last_evaluation or (-1, {})
        if step != self.state.step:
            results = self._evaluate()
            self.trackers.write(self.state.step, results)
        record.after, record.after_step = results, self.state.step
        (self.run_dir / "eval.json").write_text(json.dumps(record.to_json(), indent=2))

    def _num_eval_prompts(self) -> int:
        return min(len(self.prepared.eval_dataset), self.config.data.num_eval_prompts)

    def _drop_abandoned_rows(self) -> None:
        """A resumed run continues from its checkpoint's step: rows an interrupted run logged past it would be
        logged again, and plots would zig-zag."""
        dropped = self.sink.drop_after(self.state.step)
        if dropped:
            log.info("metrics.jsonl: dropped %d rows past step %d, the checkpoint resumed from", dropped,
                     self.state.step)  # fmt: skip

    def _should_save(self) -> bool:
        t = self.config.trainer
        return t.save_strategy == "steps" and self.state.step % t.save_steps == 0

    def _save(self) -> None:
        self.state.prompt_index = self.progress.cursor
        self.state.prompts_consumed = self.progress.consumed
        self.state.done_after_index = sorted(self.progress.done)
        self.state.extra["num_tokens"] = self.num_tokens
        self.state.extra["loss"] = self.loss.state_dict()
        self.state.extra["reward_range"] = self.assembler.watch.rewards.to_json()  # which reward solves the task
        self.state.extra["freeze_vision_tower"] = self.config.model.freeze_vision_tower  # a resume keeps it
        step, results = self.last_evaluation or (-1, {})
        self.state.extra["evaluation"] = results if step == self.state.step else {}  # a resume's "before"
        if self.scaler.is_enabled():
            self.state.extra["grad_scaler"] = self.scaler.state_dict()  # the loss scale every rank resumes with
        t = self.config.trainer
        write = "model" if t.save_only_model else "save"
        path = save_checkpoint(self.output_dir, self.state, self.prepared.tokenizer, self.scheduler, t.save_total_limit,
                               lambda tmp: self._write_sharded(tmp, write), self.world, self.processor_files,
                               model_only=t.save_only_model)  # fmt: skip
        log.info("checkpoint %s", path)
        self.callbacks.call("on_save", self.state, checkpoint=path)

    def _write_final_model(self) -> Path:
        """``model/``: the weights (in the serving dtype), the tokenizer and processor files, published whole."""
        final = self.output_dir / "model"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self._write_sharded(tmp, "model")
        self.prepared.tokenizer.save_pretrained(tmp)
        save_processor_files(self.processor_files, tmp)
        publish(tmp, final)
        return final

    def _save_final_model(self) -> None:
        final = self._write_final_model()
        self._drain_worker_metrics()
        launch_steps = self.state.step - self.console.start_step
        summary = self.timeline.write(self.run_dir / "timeline.json", self.started_at, self.run_started, time.time(),
                                      launch_steps)  # fmt: skip
        self.console.finish(self.state.step, final, summary["wall_s"])

    def _write_sharded(self, directory: Path, command: str) -> None:
        """With every rank: ``save`` the resume shards and the consolidated model, or the consolidated ``model``
        alone (the final model, a trainer.save_only_model checkpoint)."""
        self.ranks.command(command, [str(directory)] * self.world)
        save_weights(directory, self.model, self.optimizer, self.ranks, torch_dtype(self.prepared.plan.serving_dtype),
                     resumable=command == "save")  # fmt: skip

    def _stop_worker(self) -> None:
        self.channels.stop()
        self.worker.join(timeout=5)
        if self.worker.is_alive():
            self.worker.terminate()
            self.worker.join(timeout=5)
        if self.worker.is_alive():
            self.worker.kill()

    def close(self) -> None:
        """Stop the worker (it never outlives the trainer), release the sync staging area and log the last row's
        recompiles."""
        self._stop_worker()
        self.sync.close()
        report_last_row()
        self.trackers.close()
        if self.completions_hub is not None:
            self.completions_hub.close()  # waits a bounded time for the last commit
        self.console.close()


def _qsize(q: Any) -> float:
    try:
        return float(q.qsize())
    except NotImplementedError:  # multiprocessing.Queue.qsize is unimplemented on macOS (no sem_getvalue)
        return float("nan")
