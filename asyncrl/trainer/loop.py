"""The training loop: pull -> plan -> step -> sync -> checkpoint, with the rollout worker running beside it.

`Trainer.train` reads top to bottom as the spec's loop. Rank-0-only parts (worker, weight sync, logging,
checkpoints) are isolated in their own methods. The Trainer is rank 0 of the trainer's ranks, a world of one
when the run has one process: at each collective point (a step's rows, a weight sync, a checkpoint) it commands
the other ranks (trainer/distributed.py), and every world size runs the same sharded model, step and checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from asyncrl.client import policy_model
from asyncrl.config.schema import Config
from asyncrl.control_group import ControlGroup
from asyncrl.dtypes import torch_dtype
from asyncrl.evaluate import evaluate
from asyncrl.flow import FlowControl
from asyncrl.losses.step import StepLoss
from asyncrl.metrics import JsonlSink, MetricWindow
from asyncrl.restart import restart_count
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.spawn import send_spec, spawn_worker
from asyncrl.rollout.worker import WorkerSpec
from asyncrl.server.command import served_model_name, serving_dtype
from asyncrl.server.handle import check_alive
from asyncrl.trackers import build_trackers
from asyncrl.trainer.assembler import PromptProgress, RolloutWorkerError, Step, StepAssembler
from asyncrl.trainer.checkpoint import (
    TrainerState,
    load_checkpoint,
    publish,
    save_checkpoint,
    save_processor_files,
    source_processor_files,
)
from asyncrl.trainer.console import Console
from asyncrl.trainer.distributed import build_sharded, split_rows, train_rows
from asyncrl.trainer.flops import mfu_meter
from asyncrl.trainer.fsdp import GatheredModel, clip_grad_norm, save_weights
from asyncrl.trainer.group_watch import GroupWatch
from asyncrl.trainer.lora import is_peft
from asyncrl.trainer.model import use_cpu_threads
from asyncrl.trainer.moe import router_aux_coef
from asyncrl.trainer.profiler import phase, profiled_step
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.setup import Prepared
from asyncrl.trainer.step_metrics import batch_metrics, perf_metrics, sample_events
from asyncrl.trainer.timeline import Timeline
from asyncrl.trainer.weight_sync import WeightSyncError, build_weight_sync

log = logging.getLogger("asyncrl.trainer")


def run_training(config: Config, run_dir: Path, server: Any, prepared: Prepared, ranks: Ranks) -> None:
    """Train as rank 0 of ``ranks`` (trainer/distributed.py)."""
    trainer = Trainer(config, run_dir, server, prepared, ranks)
    try:
        trainer.train()
    finally:
        trainer.close()


class Trainer:
    def __init__(self, config: Config, run_dir: Path, server: Any, prepared: Prepared, ranks: Ranks) -> None:
        self.config, self.run_dir, self.server, self.prepared = config, run_dir, server, prepared
        self.ranks, self.world = ranks, ranks.world
        use_cpu_threads(config, self.world)
        self.output_dir = Path(config.trainer.output_dir or run_dir)
        self.control = ControlGroup.connect(server.base_urls, timeout_s=config.server.timeout)  # every replica
        self.flow = FlowControl.from_config(config)
        self.channels = WorkerChannels.create(1)
        self.worker = spawn_worker(self.channels)  # it imports, and the model loads, while a launched server boots
        try:
            self._set_up()
        except BaseException:
            self._stop_worker()
            raise

    def _set_up(self) -> None:
        """Everything after the worker's spawn: the model (while a launched server boots), the server's limits,
        the loss, packing, logging, the weight-sync channel, the first evaluation, and the worker's spec."""
        c = self.config
        self.model, self.optimizer, self.scheduler, resume = build_sharded(c, self.run_dir, self.ranks)
        self.processor_files = source_processor_files(c, self.model.config)
        self.server.ready()
        self.max_model_len = self.control.max_model_len()
        self.state = TrainerState(step=0, model_version=0, prompt_index=0, prompts_consumed=0, extra={})
        if resume is not None:
            self.state = load_checkpoint(resume, self.scheduler)
            log.info("resumed from %s at step %d, prompt %d", resume, self.state.step, self.state.prompt_index)
        components = self.prepared.components
        self.loss = StepLoss(components.loss, components.advantage, c.sampling.max_completion_length)
        self.loss.load_state_dict(self.state.extra.get("loss", {}))
        self.loss.router_aux_coef = router_aux_coef(c, self.model.config)
        self.top_k = c.sampling.num_sampler_logprobs if "sampler_top_logprobs" in self.loss.requires else 0
        self.mfu, self.step_flops = mfu_meter(c, self.model.config, self.world), 0.0
        self.row_factory, self.token_budget = components.packer.rows(self.max_model_len)
        self.window, self.timeline = MetricWindow(), Timeline()
        self.sink = JsonlSink(self.run_dir / "metrics.jsonl")
        self.restarts = restart_count(self.run_dir)
        self.console = Console(c)
        self.trackers = build_trackers(c, self.run_dir)
        self.completions: list[dict[str, Any]] = []
        self.sync = build_weight_sync(c, self.control, self.run_dir, self.prepared)
        self.sync.init(self._sync_view())
        if resume is not None:
            self._push(self.state.model_version)  # the server starts from the base weights
        self.evaluations = {"before": self._evaluate()} if self.prepared.eval_dataset is not None else {}
        self._start_worker()

    # ---- the loop --------------------------------------------------------------------------------------------

    def train(self) -> None:
        self.run_started = time.time()
        while not self._finished():
            step_started = time.perf_counter()
            with profiled_step(self.state.step + 1, self.config.logging.profile_steps, self.run_dir / "profile"):
                with phase("rollout_wait"):
                    step = self.assembler.next_step(
                        sync_follows=(self.state.step + 1) % self.config.staleness.weight_sync_steps == 0
                    )
                self.window.add("rollout/queue_size", _qsize(self.channels.rollout_queue) + self.assembler.held)
                if not step.rows:
                    break
                rows = self._optimize(step)
                self.state.step += 1
                if self.flow.grant_before_sync():
                    self._grant_allowance(step, rows)
                if self.state.step % self.config.staleness.weight_sync_steps == 0:
                    with phase("weight_sync"):
                        self._sync_weights()
                if not self.flow.grant_before_sync():
                    self._grant_allowance(step, rows)
            self._record_step_time(step, time.perf_counter() - step_started)
            if self.state.step % self.config.trainer.logging_steps == 0:
                self._log()
            if self._should_save():
                self._save()
            if step.final:
                break
        if self.state.step % self.config.staleness.weight_sync_steps != 0:
            self._sync_weights()  # the server, and the evaluation below, get the final weights
        if self.config.trainer.save_strategy == "steps" and not self._should_save():
            self._save()  # the last step is always resumable
        self._save_final_model()
        if self.evaluations:
            self.evaluations["after"] = self._evaluate()
            self._report_evaluations()
        self.ranks.command("stop")

    def _finished(self) -> bool:
        t = self.config.trainer
        if t.max_steps > 0:
            return self.state.step >= t.max_steps
        total = self.prepared.total_prompts(self.config)
        return total is not None and self.progress.cursor >= total

    def _optimize(self, step: Step) -> list[Any]:
        rows = [row.pack(self.top_k) for row in step.rows]
        self.loss.start_step(rows)
        self.model.train()
        started = time.time()
        fwd_s, fwd_bwd_s, rank_metrics = self._forward_backward(rows, step)
        t1 = time.perf_counter()
        with phase("optimizer"):
            grad_norm = clip_grad_norm(self.model, self.config.trainer.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - t1
        self.window.update(self.loss.end_step())
        for metrics in (m for rank in self.ranks.gather(rank_metrics) for m in rank):
            self.window.add("entropy", metrics.pop("entropy"))
            self.window.update(metrics)
        self.timeline.add("training", started, time.time())
        self.window.add("grad_norm", float(grad_norm))
        self.window.add("learning_rate", self.scheduler.get_last_lr()[0])
        self.window.update(batch_metrics(step, rows, self.token_budget))
        self.window.extend(sample_events(step))
        self.step_flops = self.mfu.flops(rows) if self.mfu is not None else 0.0
        self.window.update(perf_metrics(rows, fwd_s, fwd_bwd_s, optimizer_s, step.wait_s, self.mfu, self.step_flops))
        self.num_tokens += sum(r.num_forwarded for r in rows)
        return rows

    def _forward_backward(self, rows: list[Any], step: Step) -> tuple[float, float, list[dict[str, float]]]:
        """Forward and backward of the step's rows, each micro-batch's row r on rank r (the loss of each row is its
        share of the step's, so the gradients add up to the step's). Returns the forward and forward+backward
        seconds and this rank's per-row metrics (the others' come with the step's end)."""
        work = split_rows(rows, step.placement, (self.loss.shift, self.loss.scale))
        mine = self.ranks.command("step", work)
        result = train_rows(self.model, self.loss, mine, self.ranks, self.config)
        return result.forward_s, result.forward_backward_s, result.metrics

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
        dtype = None if is_peft(self.model) and not adapter_only else torch_dtype(serving_dtype(self.config))
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
            model_name=served_model_name(c), max_model_len=self.max_model_len,
            adapter_prefix=self.sync.adapter_prefix,
            start_prompt_index=self.state.prompt_index, total_prompts=self.prepared.total_prompts(c),
            skip_prompt_indices=frozenset(self.state.done_after_index),
        )  # fmt: skip
        send_spec(spec, self.channels)
        self.assembler = StepAssembler(
            self.channels, self.row_factory, self.token_budget, c.trainer.gradient_accumulation_steps,
            self.flow, self.progress, self.window, self._check_processes,
            c.staleness.rollout_worker_timeout, dp=self.world,
            watch=GroupWatch(c.rollout.max_consecutive_dropped_groups, c.rollout.max_failed_group_fraction),
        )  # fmt: skip

    def _check_processes(self) -> None:
        check_alive(self.server)
        self.sync.check()  # a failed resume leaves the server paused: say so instead of waiting for rollouts
        if not self.worker.is_alive() and self.channels.failure() is None:
            raise RolloutWorkerError(f"the rollout worker exited with code {self.worker.exitcode} without an error")

    def _log(self) -> None:
        self._drain_worker_metrics()
        metrics = self.window.reduce()
        metrics["num_tokens"] = self.num_tokens
        metrics["model_version"] = self.state.model_version
        metrics["perf/restarts"] = self.restarts
        metrics["epoch"] = self.progress.consumed / max(1, len(self.prepared.dataset))
        metrics["time_s"] = time.time() - self.run_started
        self.sink.write(self.state.step, metrics)
        self.trackers.write(self.state.step, metrics)
        self.console.log_step(self.state.step, metrics)
        if self.completions:
            self.console.log_completions(self.completions)
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

    def _evaluate(self) -> dict[str, float]:
        self.sync.settle()  # the server generates again after the last sync
        p = self.prepared
        model = policy_model(served_model_name(self.config), self.sync.adapter_prefix, self.state.model_version)
        return evaluate(self.config, self.server.base_urls, model, p.tokenizer,
                        p.eval_dataset, p.components.rewards, self.max_model_len)  # fmt: skip

    def _report_evaluations(self) -> None:
        import json

        (self.run_dir / "eval.json").write_text(json.dumps(self.evaluations, indent=2))
        before, after = self.evaluations["before"], self.evaluations["after"]
        lines = [f"{name}: {before[name]:.3f} -> {after[name]:.3f}" for name in before]
        self.console.note("held-out evaluation (before -> after): " + "; ".join(lines))

    def _should_save(self) -> bool:
        t = self.config.trainer
        return t.save_strategy == "steps" and self.state.step % t.save_steps == 0

    def _save(self) -> None:
        self.state.prompt_index = self.progress.cursor
        self.state.prompts_consumed = self.progress.consumed
        self.state.done_after_index = sorted(self.progress.done)
        self.state.extra["num_tokens"] = self.num_tokens
        self.state.extra["loss"] = self.loss.state_dict()
        path = save_checkpoint(self.output_dir, self.state, self.prepared.tokenizer, self.scheduler,
                               self.config.trainer.save_total_limit, lambda tmp: self._write_sharded(tmp, "save"),
                               self.world, self.processor_files)  # fmt: skip
        log.info("checkpoint %s", path)

    def _save_final_model(self) -> None:
        final = self.output_dir / "model"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self._write_sharded(tmp, "final")
        self.prepared.tokenizer.save_pretrained(tmp)
        save_processor_files(self.processor_files, tmp)
        publish(tmp, final)
        self._drain_worker_metrics()
        self.timeline.write(self.run_dir / "timeline.json", self.run_started, time.time())
        self.console.finish(self.state.step, final)

    def _write_sharded(self, directory: Path, command: str) -> None:
        """With every rank: ``save`` the resume shards and the consolidated model, or the ``final`` model only."""
        self.ranks.command(command, [str(directory)] * self.world)
        save_weights(directory, self.model, self.optimizer, self.ranks, torch_dtype(serving_dtype(self.config)),
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
        """Stop the worker (it never outlives the trainer) and release the sync staging area."""
        self._stop_worker()
        self.sync.close()
        self.trackers.close()
        self.console.close()


def _qsize(q: Any) -> float:
    try:
        return float(q.qsize())
    except NotImplementedError:  # multiprocessing.Queue.qsize is unimplemented on macOS (no sem_getvalue)
        return float("nan")
