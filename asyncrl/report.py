"""`asyncrl report RUN_DIR`: PNG plots and one self-contained HTML page from a run's metrics.jsonl.

A multirun sweep directory (jobs 0/, 1/, ... each with metrics.jsonl and .hydra/overrides.yaml) gets each
job's own report plus a page comparing the jobs. Plots whose metrics were never logged are left out.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import offset_copy

from asyncrl.flow import FlowControl
from asyncrl.metrics import read_jsonl
from asyncrl.trainer.console import diagnose_bottleneck
from asyncrl.trainer.timeline import merge

Records = list[dict[str, Any]]
STEP_PARTS = ("perf/fwd_bwd_s", "perf/optimizer_s", "perf/weight_sync_s", "perf/rollout_wait_s")
_QUEUE_METRICS = (
    "perf/rollout_wait_s",
    "rollout/backpressure_s",
    "perf/step_s",
    "rollout/queue_size",
    "batch/samples_per_step",
    "sample/staleness_mean",
)
BOTTOM_IN, LEGEND_ROW_IN = 0.55, 0.2
"""Inches under the axes for the tick labels and the axis label; for each row of a legend below them."""


def series(records: Records, name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, leaving out steps where it was absent or NaN."""
    points = [(float(r["step"]), float(v)) for r in records if _is_number(v := r.get(name))]
    return [s for s, _ in points], [v for _, v in points]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _lines(ax: Axes, records: Records, names: tuple[str, ...], gaps: bool = False, **style: Any) -> bool:
    """A line per metric that has values; ``gaps``: broken at the steps without one (a window without dropped
    groups has no reward_dropped: a line across it would show values nothing measured)."""
    drawn = False
    for name in names:
        x, y = series(records, name)
        if x:
            if gaps:
                x, y = _with_gaps(records, name)
            ax.plot(x, y, label=name, marker="." if len(x) < 40 else None, **style)
            drawn = True
    return drawn


def _with_gaps(records: Records, name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric at every step, NaN (no line drawn) where it is absent."""
    values = [r.get(name) for r in records]
    return [float(r["step"]) for r in records], [float(v) if _is_number(v) else math.nan for v in values]


def _figure(ncols: int = 1, left: float = 0.85) -> tuple[Figure, list[Axes]]:
    """Axes in margins fixed in inches (``left``: room for tick labels of six digits and the axis label; the
    title and a right axis): a layout engine draws every figure twice, once to measure it, which was a third of a
    report's time."""
    width, height = (6 * ncols if ncols > 1 else 8), 4
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    right, top, gap = 0.75, 0.35, 0.85  # inches
    panel = (width - left - right - gap * (ncols - 1)) / ncols
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=BOTTOM_IN / height, top=1 - top / height,
                        wspace=gap / panel)  # fmt: skip
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _finish(ax: Axes, title: str, ylabel: str, xlabel: str = "optimizer step", twin: Axes | None = None) -> None:
    """Title, labels, grid, and the legend of ``ax`` and its ``twin`` (a right axis) below the axes."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + (twin.get_legend_handles_labels()[0] if twin else [])
    _legend_below(ax, handles)


def _legend_below(ax: Axes, handles: list[Artist]) -> None:
    """The legend under the axes, in a band the figure grows by: inside them it hid lines (the reward plot's
    dropped fraction, the lengths plot's minimum, the stacked step times), and matplotlib's "best" place does not
    see a right axis's lines nor avoid a filled area."""
    fig = ax.get_figure(root=True)
    ncols = 2 if ax.get_position().width * fig.get_figwidth() > 4 else 1  # inches: room for two long names
    _room_below(fig, BOTTOM_IN + 0.1 + math.ceil(len(handles) / ncols) * LEGEND_ROW_IN)
    under_labels = offset_copy(ax.transAxes, fig=fig, y=-BOTTOM_IN, units="inches")
    ax.legend(handles=handles, loc="upper center", ncols=ncols, fontsize="small", frameon=False,
              bbox_to_anchor=(0.5, 0.0), bbox_transform=under_labels)  # fmt: skip


def _room_below(fig: Figure, bottom_in: float) -> None:
    """Grow ``fig`` at its bottom until its axes, their size in inches kept, sit ``bottom_in`` above its edge."""
    width, height = fig.get_size_inches()
    params = fig.subplotpars
    below, above = params.bottom * height, (1 - params.top) * height
    if bottom_in > below:
        height += bottom_in - below
        fig.set_size_inches(width, height)
        fig.subplots_adjust(bottom=bottom_in / height, top=1 - above / height)


def plot_reward(records: Records) -> Figure | None:
    fig, (ax,) = _figure()
    if not _lines(ax, records, ("reward", "reward_kept", "reward_dropped"), gaps=True):
        return None
    x, y = series(records, "frac_reward_zero_std")
    twin = ax.twinx() if x else None
    if twin is not None:
        twin.plot(x, y, color="grey", linestyle="--", label="frac_reward_zero_std (right axis)")
        twin.set(ylabel="frac_reward_zero_std", ylim=(-0.02, 1.02))
    _finish(ax, "Reward (`reward` includes dropped groups: follow it)", "reward", twin=twin)
    return fig


def plot_lengths(records: Records) -> Figure | None:
    fig, (ax,) = _figure()
    names = (
        "completions/mean_length",
        "completions/mean_terminated_length",
        "completions/min_length",
        "completions/max_length",
    )
    if not _lines(ax, records, names):
        return None
    _finish(ax, "Completion lengths", "tokens")
    return fig


def plot_throughput(records: Records) -> Figure | None:
    fig, (ax,) = _figure()
    names = (
        "rollout/generated_tokens_per_s",
        "perf/wall_clock_trained_tokens_per_s",
        "perf/wall_clock_forwarded_tokens_per_s",
    )
    if not _lines(ax, records, names):
        return None
    _finish(ax, "Throughput: generated vs trained tokens", "tokens / s")
    return fig


def plot_staleness(records: Records) -> Figure | None:
    fig, (left, right) = _figure(ncols=2)
    stale = _lines(left, records, ("sample/staleness_mean", "sample/staleness_max"))
    queue = _lines(right, records, ("rollout/queue_size", "rollout/score_queue_size"))
    if not (stale or queue):
        return None
    _finish(left, "Staleness of trained samples", "weight versions behind")
    _finish(right, "Queues (rollout queue: samples; score queue: groups)", "queue size")
    return fig


def plot_step_time(records: Records) -> Figure | None:
    """Stacked step-time parts; the gap up to perf/step_s is everything else (planning, logging)."""
    parts = [name for name in STEP_PARTS if series(records, name)[0]]
    if not parts:
        return None
    steps = [float(r["step"]) for r in records]
    layers = [[_number(r.get(name)) for r in records] for name in parts]
    fig, (ax,) = _figure()
    ax.stackplot(steps, layers, labels=parts, alpha=0.8)
    _lines(ax, records, ("perf/step_s",), color="black", linewidth=1)
    _finish(ax, "Step time breakdown", "seconds per step")
    return fig


EVAL_METRICS = ("eval/sampled_reward", "eval/greedy_reward")


def plot_evaluation(records: Records, evaluation: dict[str, Any]) -> Figure | None:
    """Held-out rewards at logging.eval_steps (metrics.jsonl), joined by the run's first and last evaluations
    (eval.json, each at its step: a resumed run's first is its checkpoint's)."""
    fig, (ax,) = _figure()
    drawn = False
    for name in EVAL_METRICS:
        points = dict(zip(*series(records, name), strict=True))
        for end in ("before", "after"):
            value, step = evaluation.get(end, {}).get(name), evaluation.get(f"{end}_step")
            if _is_number(value) and _is_number(step):  # eval.json of an older asyncrl has no steps
                points.setdefault(float(step), float(value))
        if points:
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], label=name, marker=".")
            drawn = True
    if not drawn:
        return None
    _finish(ax, "Held-out reward (sampled: pass@1; greedy: the most likely answer)", "mean reward")
    return fig


def plot_timeline(timeline: dict[str, Any]) -> Figure | None:
    """Busy spans from the launch to the end of training (the run's wall time), the training loop's start marked:
    the busy fractions are of the loop."""
    spans, summary = timeline.get("spans", {}), timeline.get("summary", {})
    busy = {name: merge([tuple(s) for s in spans.get(name, [])]) for name in ("generation", "training")}
    if not any(busy.values()):
        return None
    launched = timeline.get("start")  # an older timeline.json has none: its first span
    origin = launched if _is_number(launched) else min(start for merged in busy.values() for start, _ in merged)
    fig, (ax,) = _figure(left=1.0)  # the rows' names as tick labels: "generation" is wider than six digits
    for row, (name, merged) in enumerate(busy.items()):
        ax.broken_barh([(s - origin, e - s) for s, e in merged], (row - 0.35, 0.7), color=f"C{row}", label=name)
    ax.set_yticks(range(len(busy)), list(busy))
    wall, loop = summary.get("wall_s"), summary.get("training_s")
    if _is_number(launched) and _is_number(wall) and _is_number(loop):
        ax.set_xlim(0, wall)
        ax.axvline(wall - loop, color="black", linestyle=":", label="training loop starts")
    overlap = summary.get("overlap_frac")
    title = "Busy spans" + ("" if overlap is None else f" (generation and training overlap {overlap:.0%} of the loop)")
    _finish(ax, title, "", xlabel="seconds since launch" if _is_number(launched) else "seconds since start")
    return fig


def _number(value: Any) -> float:
    return float(value) if _is_number(value) else 0.0


def _mean(records: Records, name: str) -> float | None:
    values = series(records, name)[1]
    return sum(values) / len(values) if values else None


def _save(fig: Figure | None, out_dir: Path, stem: str) -> Path | None:
    if fig is None:
        return None
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=100)
    return path


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _flow(run_dir: Path) -> FlowControl | None:
    """The run's flow rules from its config.yaml (which report reads as plain YAML), or None without one."""
    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else None
    max_staleness = (config or {}).get("staleness", {}).get("max_staleness")
    return None if max_staleness is None else FlowControl(max_staleness)


def run_summary(
    records: Records, run_dir: Path, timeline: dict[str, Any], evaluation: dict[str, Any]
) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table; rows whose metrics are missing are left out. ``timeline`` and
    ``evaluation``: the run's timeline.json and eval.json."""
    rows: list[tuple[str, str]] = [("steps", str(records[-1]["step"]) if records else "0")]
    rewards = series(records, "reward")[1]
    optional = {
        "wall time": _wall_time(records, timeline),
        "final reward": f"{rewards[-1]:.4f}" if rewards else None,
        "best reward": f"{max(rewards):.4f}" if rewards else None,
        **_held_out(evaluation),
    }
    for label, name, fmt in (
        ("mean generated tokens/s", "rollout/generated_tokens_per_s", "{:,.0f}"),
        ("mean trained tokens/s", "perf/wall_clock_trained_tokens_per_s", "{:,.0f}"),
        ("mean staleness", "sample/staleness_mean", "{:.2f}"),
        ("mean frac_reward_zero_std", "frac_reward_zero_std", "{:.2f}"),
    ):
        value = _mean(records, name)
        optional[label] = None if value is None else fmt.format(value)
    for key, value in timeline.get("summary", {}).items():
        if key.endswith("_frac"):  # of the training loop's time
            optional[f"timeline {key}"] = f"{value:.1%}"
    flow = _flow(run_dir)
    queue = {name: m for name in _QUEUE_METRICS if (m := _mean(records, name)) is not None}
    if flow is not None and queue:
        optional["bottleneck (run means)"] = diagnose_bottleneck(queue, flow)
    return rows + [(label, value) for label, value in optional.items() if value is not None]


def _wall_time(records: Records, timeline: dict[str, Any]) -> str | None:
    """The run's wall time as timeline.json records it (trainer/timeline.py: launch to end of training, the figure
    the console's closing line gives); a resumed run's is its last launch's. Without one (an older or unfinished
    run), the last step's time_s: from the training loop's start."""
    summary = timeline.get("summary", {})
    wall, launch_steps = summary.get("wall_s"), summary.get("launch_steps")
    if not _is_number(wall):
        times = series(records, "time_s")[1]
        return f"{times[-1]:.0f} s (to the last logged step)" if times else None
    steps = records[-1]["step"] if records else 0
    if _is_number(launch_steps) and launch_steps < steps:
        return f"{wall:.0f} s (the last launch: {launch_steps} of the {steps} steps, resumed)"
    return f"{wall:.0f} s"


def _held_out(evaluation: dict[str, Any]) -> dict[str, str]:
    """eval.json's held-out rewards before and after training, a row per score."""
    before, after = evaluation.get("before", {}), evaluation.get("after", {})
    ends = ""
    if _is_number(evaluation.get("after_step")):
        ends = f" ({evaluation.get('before_model', 'start')} -> step {evaluation['after_step']})"
    return {
        f"held-out {name.removeprefix('eval/').replace('_', ' ')}": f"{before[name]:.3f} -> {after[name]:.3f}{ends}"
        for name in EVAL_METRICS
        if _is_number(before.get(name)) and _is_number(after.get(name))
    }


# ---- HTML ---------------------------------------------------------------------------------------------------

_STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}"
    "img{max-width:100%;display:block;margin:1em 0}"
)


def _table(header: list[str] | None, rows: list[list[str]]) -> str:
    head = "" if header is None else "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _page(title: str, sections: list[str]) -> str:
    body = "\n".join(sections)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )


# ---- single run and sweep -----------------------------------------------------------------------------------

_PLOTS: tuple[tuple[str, Callable[[Records], Figure | None]], ...] = (
    ("reward", plot_reward),
    ("lengths", plot_lengths),
    ("throughput", plot_throughput),
    ("staleness_queue", plot_staleness),
    ("step_time", plot_step_time),
)


def _run_report(run_dir: Path) -> Path:
    out_dir = run_dir / "report"
    out_dir.mkdir(exist_ok=True)
    records = read_jsonl(run_dir / "metrics.jsonl")
    timeline, evaluation = _read_json(run_dir / "timeline.json"), _read_json(run_dir / "eval.json")
    images = [_save(plot(records), out_dir, stem) for stem, plot in _PLOTS]
    images.append(_save(plot_evaluation(records, evaluation), out_dir, "evaluation"))
    images.append(_save(plot_timeline(timeline), out_dir, "timeline"))
    summary = run_summary(records, run_dir, timeline, evaluation)
    sections = ["<h2>Summary</h2>", _table(None, [[html.escape(k), html.escape(v)] for k, v in summary])]
    sections += [_image(path) for path in images if path is not None]
    if not records:
        sections.append("<p>No metrics were logged.</p>")
    page = out_dir / "index.html"
    page.write_text(_page(f"asyncrl run {run_dir.name}", sections))
    return page


def sweep_jobs(sweep_dir: Path) -> list[Path]:
    """Job directories of a Hydra multirun, in job-number order."""
    jobs = [
        p
        for p in sweep_dir.iterdir()
        if (p / "metrics.jsonl").is_file() and (p / ".hydra" / "overrides.yaml").is_file()
    ]
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def job_label(job_dir: Path) -> str:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    return " ".join(overrides) or "(defaults)"


def plot_overlay(jobs: list[Path]) -> Figure | None:
    fig, (ax,) = _figure()
    drawn = False
    for job in jobs:
        x, y = series(read_jsonl(job / "metrics.jsonl"), "reward")
        if x:
            ax.plot(x, y, label=f"{job.name}: {job_label(job)}", marker="." if len(x) < 40 else None)
            drawn = True
    if not drawn:
        return None
    _finish(ax, "Reward per job", "reward")
    return fig


def _job_report(job_dir: Path) -> Path:
    """The job's own page, written again only when its metrics are newer: each job writes its page as it ends and
    then the sweep's, so rendering every job's plots anew would add N*(N+1)/2 run reports to a sweep of N jobs."""
    page = job_dir / "report" / "index.html"
    if page.is_file() and page.stat().st_mtime_ns >= (job_dir / "metrics.jsonl").stat().st_mtime_ns:
        return page
    return _run_report(job_dir)


def _sweep_report(sweep_dir: Path, jobs: list[Path]) -> Path:
    out_dir = sweep_dir / "report"
    out_dir.mkdir(exist_ok=True)
    rows = []
    for job in jobs:
        timeline, evaluation = _read_json(job / "timeline.json"), _read_json(job / "eval.json")
        summary = dict(run_summary(read_jsonl(job / "metrics.jsonl"), job, timeline, evaluation))
        link = f'<a href="../{html.escape(job.name)}/report/{_job_report(job).name}">report</a>'
        cells = [job.name, job_label(job)] + [
            summary.get(k, "-") for k in ("steps", "final reward", "best reward", "wall time")
        ]
        rows.append([html.escape(c) for c in cells] + [link])
    header = ["job", "overrides", "steps", "final reward", "best reward", "wall time", ""]
    sections = ["<h2>Jobs</h2>", _table(header, rows)]
    overlay = _save(plot_overlay(jobs), out_dir, "reward_overlay")
    if overlay is not None:
        sections.append(_image(overlay))
    page = out_dir / "index.html"
    page.write_text(_page(f"asyncrl sweep {sweep_dir.name}", sections))
    return page


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report/` (PNGs + index.html) for a run or a multirun sweep; returns the HTML page."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "not a directory" if run_dir.exists() else "no such directory"
        raise FileNotFoundError(f"{run_dir}: {what}; name a run's directory (runs/<date>_<time>) or a sweep's")
    if (run_dir / "metrics.jsonl").is_file():
        return _run_report(run_dir)
    jobs = sweep_jobs(run_dir)
    if not jobs:
        raise FileNotFoundError(
            f"{run_dir}: no metrics.jsonl, and no multirun jobs (0/, 1/, ... with "
            "metrics.jsonl and .hydra/overrides.yaml)"
        )
    return _sweep_report(run_dir, jobs)
