"""What the user sees while training: a live rich display on a terminal, else one plain line per logging step.

The trainer calls `log_step` once per logging window. `diagnose_bottleneck` reads the rollout-queue metrics as
the spec's "Rollout queue" section does and names the side that limits throughput. Off a terminal nothing wraps: a
line that rich broke at 80 columns would start new lines that are no step lines to a reader or a script.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console as RichConsole
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from asyncrl.config.schema import Config
from asyncrl.flow import FlowControl
from asyncrl.rollout.images import IMAGES_COLUMN, image_count
from asyncrl.rollout.scoring import TABLE_COLUMNS, table_columns

HIGH_WAIT_FRAC = 0.1
"""A wait counts as high above this fraction of the step time (of one second when no step time was logged)."""

GENERATION_BOUND, TRAINER_BOUND, TOO_TIGHT, BALANCED = (
    "generation-bound",
    "trainer-bound",
    "max_staleness too tight",
    "balanced",
)

_PLAIN_COLUMNS = (  # (metric, label, format) in display order
    ("reward", "reward", "{:.3f}"),
    ("reward_kept", "kept", "{:.3f}"),
    ("frac_reward_zero_std", "dropped", "{:.0%}"),  # of the groups: their rewards were all equal (or None)
    ("reward_dropped", "dropped_reward", "{:.3f}"),  # the reward those groups got stuck at, not a fraction
    ("completions/mean_length", "len", "{:.1f}"),
    ("rollout/generated_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("perf/wall_clock_trained_tokens_per_s", "train tok/s", "{:.0f}"),
    ("sample/staleness_mean", "stale", "{:.2f}"),
    ("rollout/queue_size", "queue", "{:.0f}"),
    ("perf/step_s", "step_s", "{:.2f}"),
)
_COLOURS = {GENERATION_BOUND: "yellow", TRAINER_BOUND: "cyan", TOO_TIGHT: "red", BALANCED: "green"}
EVAL_LINE_EVERY_S = 30.0
"""Off a terminal, a held-out evaluation's progress line comes at most this often (one that ends sooner prints none)."""
EvalProgress = Callable[[str, int, int], None]
"""Called by a held-out evaluation as its completions come back: (pass: greedy or sampled, done, total)."""


def _value(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def classify_bottleneck(metrics: Mapping[str, Any]) -> str | None:
    """Which side waits on the other: the mirror-image waits decide, the queue size only illustrates."""
    wait, backpressure = _value(metrics, "perf/rollout_wait_s"), _value(metrics, "rollout/backpressure_s")
    if wait is None and backpressure is None:
        return None
    step_s = _value(metrics, "perf/step_s")
    threshold = HIGH_WAIT_FRAC * (step_s if step_s and step_s > 0 else 1.0)
    starving, throttled = (wait or 0.0) > threshold, (backpressure or 0.0) > threshold
    if starving and throttled:
        return TOO_TIGHT
    return GENERATION_BOUND if starving else TRAINER_BOUND if throttled else BALANCED


def diagnose_bottleneck(metrics: Mapping[str, Any], flow: FlowControl) -> str:
    """One line naming the bottleneck and what to look at, per the spec's rollout-queue diagnosis; ``flow`` says
    whether the run is synchronous."""
    label = classify_bottleneck(metrics)
    if label is None:
        return "bottleneck unknown: no perf/rollout_wait_s or rollout/backpressure_s in this window"
    wait = _value(metrics, "perf/rollout_wait_s") or 0.0
    backpressure = _value(metrics, "rollout/backpressure_s") or 0.0
    queue = _queue_text(metrics)
    if label == GENERATION_BOUND:
        return (
            f"{label}: training waited {wait:.2f} s/step for samples ({queue}); look at "
            "rollout/generated_tokens_per_s, rollout/concurrency, rollout/worker_cpu (near 1: the rollout worker's "
            "core is the limit) and rollout/score_queue_size"
        )
    if label == TRAINER_BOUND:
        staleness = _value(metrics, "sample/staleness_mean")
        stale = "" if staleness is None else f", staleness {staleness:.1f} of max {flow.max_staleness}"
        return f"{label}: generation waited {backpressure:.2f} s for training ({queue}{stale}); training is slower"
    if label == TOO_TIGHT and flow.synchronous:
        return (
            f"{label}: synchronous mode (staleness.max_staleness=0), generation and training take turns; "
            "raise staleness.max_staleness to overlap them"
        )
    if label == TOO_TIGHT:
        return (
            f"{label}: training waited {wait:.2f} s/step while generation waited {backpressure:.2f} s "
            f"({queue}); raise staleness.max_staleness (now {flow.max_staleness})"
        )
    return f"{label}: training waited {wait:.2f} s/step, generation {backpressure:.2f} s ({queue})"


def _queue_text(metrics: Mapping[str, Any]) -> str:
    queue, per_step = _value(metrics, "rollout/queue_size"), _value(metrics, "batch/samples_per_step")
    if queue is None:
        return "queue size not logged"
    steps = f" = {queue / per_step:.1f} steps" if per_step else ""
    return f"queue {queue:.0f} samples{steps}"


def servers_text(metrics: Mapping[str, Any]) -> str | None:
    """With several servers: each one's share of the window's requests (are they balanced?) and their load summed
    from every /metrics (KV usage: the fullest server's); None with one server."""
    counts = []
    while (count := _value(metrics, f"rollout/server_{len(counts)}_request_count")) is not None:
        counts.append(count)
    if len(counts) < 2:
        return None
    total = sum(counts) or 1.0
    shares = "/".join(f"{count / total:.0%}" for count in counts)
    return (
        f"{len(counts)} servers: requests {shares}"
        f"  KV max {_fmt(metrics, 'rollout/vllm_kv_cache_usage_frac', '{:.0%}')}"
        f"  running {_fmt(metrics, 'rollout/vllm_running_requests', '{:.0f}')}"
        f"  queued {_fmt(metrics, 'rollout/vllm_queued_requests', '{:.0f}')}"
    )


def _fmt(metrics: Mapping[str, Any], key: str, fmt: str) -> str:
    value = _value(metrics, key)
    return "-" if value is None else fmt.format(value)


def _extra(record: dict[str, Any], name: str) -> str:
    """A ``log_extra`` column's cell; the prompt's images (logging.log_multimodal) as their count."""
    return image_count(record[name]) if name == IMAGES_COLUMN else str(record[name])


def _text(value: Any) -> str:
    """A prompt is a string or a list of chat messages; show messages as `role: content` lines."""
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return str(value)


class Console:
    """Live display (progress, numbers, bottleneck) on a terminal; one plain line per logging step elsewhere."""

    def __init__(
        self, config: Config, flow: FlowControl, start_step: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``start_step``: the step a resumed run starts from (the closing line counts this launch's steps);
        ``clock`` paces the plain evaluation lines (a test's own clock)."""
        mode = config.logging.console
        if mode not in ("auto", "live", "plain"):
            raise ValueError(f"logging.console={mode!r} must be one of auto, live, plain")
        self.live_mode = mode == "live" or (mode == "auto" and sys.stdout.isatty())
        self.console = RichConsole(
            highlight=False, force_terminal=True if mode == "live" else None, soft_wrap=not self.live_mode
        )
        self.config = config
        self.max_steps = config.trainer.max_steps
        self.flow = flow
        self.start_step, self.clock = start_step, clock
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        by_steps = self.max_steps > 0
        self.task = self.progress.add_task(
            self._position(start_step, 0.0),
            total=self.max_steps if by_steps else config.trainer.num_train_epochs,
            completed=start_step if by_steps else 0,
        )
        self.live: Live | None = None
        self.view: Group = Group(self.progress)

    def _position(self, step: int, epoch: float) -> str:
        if self.max_steps > 0:
            return f"step {step}/{self.max_steps}"
        return f"step {step}  epoch {epoch:.2f}/{self.config.trainer.num_train_epochs:g}"

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.live_mode:
            self.console.print(self._plain_line(step, metrics), soft_wrap=True)
            return
        epoch = _value(metrics, "epoch") or 0.0
        done = step if self.max_steps > 0 else epoch
        self.progress.update(self.task, completed=done, description=self._position(step, epoch))
        self._show(Group(self.progress, self._stats(metrics)))

    def _show(self, view: Group) -> None:
        """The live display shows ``view`` from now on; it starts with the first."""
        self.view = view
        if self.live is None:
            self.live = Live(view, console=self.console, refresh_per_second=4)
            self.live.start()
        else:
            self.live.update(view)

    @contextmanager
    def evaluating(self) -> Iterator[EvalProgress]:
        """A held-out evaluation's progress (a 135M model's 200 prompts took over 10 minutes on a CPU, silent until
        now): a bar under training's on a terminal, else a line at most every EVAL_LINE_EVERY_S seconds."""
        if not self.live_mode:
            yield self._eval_line(self.clock())
            return
        task = self.progress.add_task("held-out evaluation", total=None)
        self._show(self.view)

        def show(label: str, done: int, total: int) -> None:
            self.progress.update(task, description=f"held-out evaluation, {label}", completed=done, total=total)

        try:
            yield show
        finally:
            self.progress.remove_task(task)

    def _eval_line(self, started: float) -> EvalProgress:
        last = started

        def line(label: str, done: int, total: int) -> None:
            nonlocal last
            now = self.clock()
            if now - last >= EVAL_LINE_EVERY_S:
                last = now
                self.note(f"held-out evaluation, {label}: {done}/{total} completions")

        return line

    def _plain_line(self, step: int, metrics: Mapping[str, Any]) -> str:
        parts = [f"[bold]{self._position(step, _value(metrics, 'epoch') or 0.0)}[/bold]"]
        for key, label, fmt in _PLAIN_COLUMNS:
            value = _value(metrics, key)
            if value is not None:
                parts.append(f"{label} {fmt.format(value)}")
        servers = servers_text(metrics)
        if servers is not None:
            parts.append(servers)
        label = classify_bottleneck(metrics)
        if label is not None:
            parts.append(f"[{_COLOURS[label]}]{label}[/]")
        return "  ".join(parts)

    def _stats(self, metrics: Mapping[str, Any]) -> Group:
        """Reward line, throughput line and bottleneck line under the progress bar."""
        reward = "  ".join(
            (
                f"reward [bold]{_fmt(metrics, 'reward', '{:.3f}')}[/]",
                f"kept {_fmt(metrics, 'reward_kept', '{:.3f}')}",
                f"dropped {_fmt(metrics, 'frac_reward_zero_std', '{:.0%}')} of groups "
                f"(their reward {_fmt(metrics, 'reward_dropped', '{:.3f}')})",
                f"length {_fmt(metrics, 'completions/mean_length', '{:.1f}')}",
            )
        )
        flow = "  ".join(
            (
                f"generated {_fmt(metrics, 'rollout/generated_tokens_per_s', '{:,.0f}')} tok/s",
                f"trained {_fmt(metrics, 'perf/wall_clock_trained_tokens_per_s', '{:,.0f}')} tok/s",
                f"staleness {_fmt(metrics, 'sample/staleness_mean', '{:.2f}')} "
                f"(max {_fmt(metrics, 'sample/staleness_max', '{:.0f}')}, limit {self.flow.max_staleness})",
                f"queue {_fmt(metrics, 'rollout/queue_size', '{:.0f}')}",
                f"step {_fmt(metrics, 'perf/step_s', '{:.2f}')} s",
            )
        )
        colour = _COLOURS.get(classify_bottleneck(metrics) or "", "dim")
        servers = servers_text(metrics)
        lines = [reward, flow] if servers is None else [reward, flow, servers]
        return Group(*lines, f"[{colour}]{escape(diagnose_bottleneck(metrics, self.flow))}[/]")

    def log_completions(self, records: list[dict[str, Any]]) -> None:
        """A table of (prompt, completion, reward, advantage) and the columns reward functions added through
        ``log_extra``, when logging.log_completions asks for it."""
        if not self.config.logging.log_completions or not records:
            return
        limit = self.config.logging.num_completions_to_print
        shown = records if limit is None else records[:limit]
        table = Table(title="completions", caption=f"{len(shown)} of {len(records)}", show_lines=True)
        for name in ("prompt", "completion"):
            table.add_column(name, overflow="fold")
        table.add_column("reward", justify="right")
        table.add_column("advantage", justify="right")
        extra = table_columns(shown)[len(TABLE_COLUMNS) :]
        for name in extra:
            table.add_column(escape(name), overflow="fold")
        for r in shown:
            table.add_row(
                escape(_text(r["prompt"])),
                escape(_text(r["completion"])),
                _fmt(r, "reward", "{:.3f}"),
                _fmt(r, "advantage", "{:+.3f}"),
                *(escape(_extra(r, name)) if name in r else "-" for name in extra),
            )
        self.console.print(table)

    def note(self, text: str) -> None:
        """A line outside the live display (evaluation results, warnings)."""
        self.console.print(text)

    def finish(self, step: int, model_dir: Path, wall_s: float) -> None:
        """The closing line: the run's steps (and this launch's, after a resume) and its wall time (timeline.json's
        wall_s, the figure the report gives too)."""
        self.close()
        launch = f" ({step - self.start_step} in this launch)" if self.start_step else ""
        saved = escape(str(model_dir))
        self.console.print(f"[green]done[/green] after {step} steps{launch} in {wall_s:.0f} s; model saved to {saved}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
