"""The training loop: pull -> plan -> step -> sync -> checkpoint, with the rollout worker running beside it.

`Trainer.train` reads top to bottom as the spec's loop. Rank-0-only parts (worker, weight sync, logging,
checkpoints) are isolated in their own methods so that a multi-rank trainer can keep them on rank 0.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from asyncrl.client import ControlClient
from asyncrl.config.schema import Config
from asyncrl.losses import LOSSES
from asyncrl.losses.step import StepLoss
from asyncrl.metrics import JsonlSink, MetricWindow
from asyncrl.packing import build_row_factory
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.spawn import start_worker
from asyncrl.rollout.worker import WorkerSpec
from asyncrl.server.command import served_model_name
from asyncrl.trainer.assembler import PromptProgress, RolloutWorkerError, Step, StepAssembler
from asyncrl.trainer.checkpoint import TrainerState, load_checkpoint, resolve_checkpoint, save_checkpoint
from asyncrl.evaluate import evaluate
from asyncrl.trackers import build_trackers
from asyncrl.trainer.console import Console
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.model import build_accelerator, build_optimizer, load_model
from asyncrl.trainer.step_metrics import batch_metrics, perf_metrics, sample_events
from asyncrl.trainer.timeline import Timeline
from asyncrl.trainer.weight_sync import build_weight_sync
from asyncrl.trainer.setup import Prepared

log = logging.getLogger("asyncrl.trainer")


def run_training(config: Config, run_dir: Path, server: Any, prepared: Prepared) -> None:
    trainer = Trainer(config, run_dir, server, prepared)
    try:
        trainer.train()
    finally:
        trainer.close()


class Trainer:
    def __init__(self, config: Config, run_dir: Path, server: Any, prepared: Prepared) -> None:
        self.config, self.run_dir, self.server, self.prepared = config, run_dir, server, prepared
        self.output_dir = Path(config.trainer.output_dir or run_dir)
        self.control = ControlClient(server.base_url, timeout_s=config.server.timeout)
        self.max_model_len = self.control.max_model_len()
        self.accelerator = build_accelerator(config)
        resume = resolve_checkpoint(config.trainer.resume_from_checkpoint, self.output_dir) \
            if config.trainer.resume_from_checkpoint else None  # fmt: skip
        model = load_model(config, str(resume) if resume else config.model.name_or_path)
        optimizer, scheduler = build_optimizer(config, model)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.state = TrainerState(step=0, model_version=0, prompt_index=0, prompts_consumed=0, extra={})
        if resume is not None:
            self.state = load_checkpoint(resume, self.optimizer, self.scheduler)
            log.info("resumed from %s at step %d, prompt %d", resume, self.state.step, self.state.prompt_index)
        self.loss = StepLoss(LOSSES.build(config.loss), prepared.advantage_fn, config.sampling.max_completion_length)
        self.loss.load_state_dict(self.state.extra.get("loss", {}))
        self.top_k = config.sampling.num_sampler_logprobs if "sampler_top_logprobs" in self.loss.requires else 0
        self.row_factory, self.token_budget = build_row_factory(dict(config.packing), self.max_model_len)
        self.attention = str(config.packing.get("attention", "auto"))
        self.window, self.timeline = MetricWindow(), Timeline()
        self.sink = JsonlSink(run_dir / "metrics.jsonl")
        self.console = Console(config)
        self.trackers = build_trackers(config, run_dir)
        self.completions: list[dict[str, Any]] = []
        self.sync = build_weight_sync(config, self.control, run_dir, prepared)
        self.sync.init()
        if resume is not None:
            self.sync.push(self.model, self.state.model_version)  # the server starts from the base weights
        self.evaluations = {"before": self._evaluate()} if prepared.eval_dataset is not None else {}
        self._start_worker()

    # ---- the loop --------------------------------------------------------------------------------------------

    def train(self) -> None:
        self.run_started = time.time()
        while not self._finished():
            step_started = time.perf_counter()
            step = self.assembler.next_step()
            if not step.rows:
                break
            rows = self._optimize(step)
            self.state.step += 1
            self._grant_allowance(step, rows)
            if self.state.step % self.config.staleness.weight_sync_steps == 0:
                self._sync_weights()
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
        fwd_s = fwd_bwd_s = 0.0
        started = time.time()
        for row in rows:
            t0 = time.perf_counter()
            out = packed_forward(self.model, row, self.config.sampling.temperature, attention=self.attention)
            loss, loss_metrics = self.loss(self.loss.batch(row, out))
            fwd_s += time.perf_counter() - t0
            self.accelerator.backward(loss)
            fwd_bwd_s += time.perf_counter() - t0
            self.window.update(loss_metrics)
            self.window.add("entropy", float(out.entropy.mean()) if out.entropy.numel() else float("nan"))
        t1 = time.perf_counter()
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.trainer.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - t1
        self.window.update(self.loss.end_step())
        self.timeline.add("training", started, time.time())
        self.window.add("grad_norm", float(grad_norm))
        self.window.add("learning_rate", self.scheduler.get_last_lr()[0])
        self.window.update(batch_metrics(step, rows, self.token_budget))
        self.window.extend(sample_events(step))
        self.window.update(perf_metrics(rows, fwd_s, fwd_bwd_s, optimizer_s, step.wait_s, self.model.config))
        self.window.add("rollout/queue_size", _qsize(self.channels.rollout_queue))
        self.num_tokens += sum(r.num_forwarded for r in rows)
        return rows

    def _record_step_time(self, step: Step, seconds: float) -> None:
        tokens = sum(s.num_tokens for s in step.samples)
        trained = sum(s.num_trained for s in step.samples)
        self.window.add("perf/step_s", seconds)
        self.window.add("perf/wall_clock_forwarded_tokens_per_s", tokens / max(seconds, 1e-9))
        self.window.add("perf/wall_clock_trained_tokens_per_s", trained / max(seconds, 1e-9))

    def _grant_allowance(self, step: Step, rows: list[Any]) -> None:
        """Let the worker hold max(max_staleness, 1) steps' worth of the tokens this step consumed.

        Synchronous mode generates exactly one batch per step, so a step is as large as the allowance: there
        it is the sample tokens that fill the step's rows at the packing ratio just measured (tree rows hold
        more sample tokens than their budget of unique tokens), never the batch itself, which would grow by
        its own overshoot every step."""
        consumed = sum(s.num_tokens for s in step.samples)
        if self.config.staleness.max_staleness == 0:
            forwarded = max(1, sum(r.num_forwarded for r in rows))
            consumed = int(self.config.trainer.gradient_accumulation_steps * self.token_budget * consumed / forwarded)
        self.channels.token_allowance.value = max(1, self.config.staleness.max_staleness) * max(consumed, 1)

    def _sync_weights(self) -> None:
        version = self.state.model_version + 1
        self.window.update(self.sync.push(self.model, version))
        self.state.model_version = version
        self.channels.model_version.value = version

    # ---- rank-0 services -------------------------------------------------------------------------------------

    def _start_worker(self) -> None:
        c = self.config
        self.progress = PromptProgress(cursor=self.state.prompt_index, consumed=self.state.prompts_consumed)
        self.num_tokens = int(self.state.extra.get("num_tokens", 0))
        rows_per_step = c.trainer.gradient_accumulation_steps
        self.channels = WorkerChannels.create(max(1, c.staleness.max_staleness) * rows_per_step * self.token_budget)
        self.channels.model_version.value = self.state.model_version
        spec = WorkerSpec(
            config=c, tokenizer=self.prepared.tokenizer, dataset=self.prepared.dataset,
            reward_sources=self.prepared.reward_sources, loop_cls=self.prepared.loop_cls,
            advantage_fn=self.prepared.advantage_fn, base_url=self.server.base_url,
            model_name=served_model_name(c), max_model_len=self.max_model_len,
            start_prompt_index=self.state.prompt_index, total_prompts=self.prepared.total_prompts(c),
        )  # fmt: skip
        self.worker = start_worker(spec, self.channels)
        self.assembler = StepAssembler(
            self.channels, self.row_factory, self.token_budget, rows_per_step, c.staleness.max_staleness,
            self.progress, self.window, self._check_processes, c.staleness.rollout_worker_timeout,
        )  # fmt: skip

    def _check_processes(self) -> None:
        if not self.server.is_alive():
            raise RuntimeError(f"the generation server died; end of its log:\n{self.server.log_tail()}")
        if not self.worker.is_alive() and not self.channels.failed_event.is_set():
            raise RolloutWorkerError(f"the rollout worker exited with code {self.worker.exitcode} without an error")

    def _log(self) -> None:
        self._drain_worker_metrics()
        metrics = self.window.reduce()
        metrics["num_tokens"] = self.num_tokens
        metrics["model_version"] = self.state.model_version
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
        p = self.prepared
        return evaluate(self.config, self.server.base_url, served_model_name(self.config), p.tokenizer,
                        p.eval_dataset, p.reward_sources, self.max_model_len)  # fmt: skip

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
        self.state.extra["num_tokens"] = self.num_tokens
        self.state.extra["loss"] = self.loss.state_dict()
        unwrapped = self.accelerator.unwrap_model(self.model)
        path = save_checkpoint(self.output_dir, self.state, unwrapped, self.prepared.tokenizer, self.optimizer,
                               self.scheduler, self.config.trainer.save_total_limit)  # fmt: skip
        log.info("checkpoint %s", path)

    def _save_final_model(self) -> None:
        final = self.output_dir / "model"
        self.accelerator.unwrap_model(self.model).save_pretrained(final)
        self.prepared.tokenizer.save_pretrained(final)
        self._drain_worker_metrics()
        self.timeline.write(self.run_dir / "timeline.json", self.run_started, time.time())
        self.console.finish(self.state.step, final)

    def close(self) -> None:
        """Stop the worker (it never outlives the trainer) and release the sync staging area."""
        self.channels.stop_event.set()
        self.worker.join(timeout=5)
        if self.worker.is_alive():
            self.worker.terminate()
            self.worker.join(timeout=5)
        if self.worker.is_alive():
            self.worker.kill()
        self.sync.close()
        self.trackers.close()
        self.console.close()


def _qsize(q: Any) -> float:
    try:
        return float(q.qsize())
    except NotImplementedError:  # macOS
        return float("nan")
