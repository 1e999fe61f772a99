"""`asyncrl report`: PNGs and one self-contained HTML page for a run, a comparison page for a sweep."""

from __future__ import annotations

import base64
import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure
from typer.testing import CliRunner

from asyncrl.cli import app
from asyncrl.report import (
    plot_evaluation,
    plot_lengths,
    plot_reward,
    plot_staleness,
    plot_step_time,
    plot_throughput,
    plot_timeline,
    series,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_PNGS = {"reward", "lengths", "throughput", "staleness_queue", "step_time", "timeline"}


def _record(step: int, slope: float) -> dict[str, float | None]:
    """One logging step of a run whose reward climbs with `slope`; reward_dropped missing on odd steps."""
    reward = min(1.0, 0.1 + slope * step)
    return {
        "step": step, "reward": reward, "reward_kept": reward * 0.9, "reward_dropped": 1.0 if step % 2 == 0 else None,
        "frac_reward_zero_std": 0.1 + 0.02 * step, "completions/mean_length": 40.0 - step,
        "completions/min_length": 10.0, "completions/max_length": 64.0,
        "rollout/generated_tokens_per_s": 900.0 + 10 * step, "perf/wall_clock_trained_tokens_per_s": 400.0,
        "sample/staleness_mean": 1.5, "sample/staleness_max": 3.0, "rollout/queue_size": 12.0,
        "perf/fwd_bwd_s": 0.5, "perf/optimizer_s": 0.1, "perf/weight_sync_s": 0.05, "perf/rollout_wait_s": 0.3,
        "rollout/backpressure_s": 0.0, "perf/step_s": 1.0, "batch/samples_per_step": 8.0,
        "epoch": step / 20, "time_s": 1.0 * step,
    }  # fmt: skip


def _write_run(run_dir: Path, steps: int = 12, slope: float = 0.05, timeline: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    lines = [json.dumps(_record(step, slope)) for step in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"staleness": {"max_staleness": 4}}))
    if timeline:
        spans = {"generation": [[100.0, 104.0], [105.0, 112.0]], "training": [[102.0, 103.0], [108.0, 111.5]]}
        summary = {"wall_s": 12.0, "generation_busy_frac": 0.92, "training_busy_frac": 0.38, "overlap_frac": 0.375}
        (run_dir / "timeline.json").write_text(json.dumps({"summary": summary, "spans": spans}))
    return run_dir


def _inline_images(page: Path) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page.read_text())]


def test_run_report_writes_every_plot_and_inlines_them(tmp_path):
    run = _write_run(tmp_path / "run")
    page = write_report(run)
    assert page == run / "report" / "index.html"
    assert {p.stem for p in (run / "report").glob("*.png")} == RUN_PNGS
    images = _inline_images(page)
    assert len(images) == len(RUN_PNGS)
    assert all(image.startswith(PNG_MAGIC) for image in images)
    text = page.read_text()
    assert "<img" in text and 'src="report/' not in text  # nothing refers to a file beside the page
    assert "final reward</td><td>0.7000" in text and "best reward</td><td>0.7000" in text
    assert "timeline overlap_frac</td><td>37.5%" in text
    assert "generation-bound" in text  # run means: 0.3 s wait per 1.0 s step


def test_evaluations_during_training_are_drawn_between_the_first_and_the_last(tmp_path):
    run = _write_run(tmp_path / "run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records[3::4]:  # logging.eval_steps=4: steps 4, 8, 12 (the last is also the "after")
        record.update({"eval/sampled_reward": record["step"] / 20, "eval/greedy_reward": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    evaluation = {"before": {"eval/sampled_reward": 0.05, "eval/greedy_reward": 1.0}, "before_step": 0,
                  "after": {"eval/sampled_reward": 0.6, "eval/greedy_reward": 1.0}, "after_step": 12}  # fmt: skip
    (run / "eval.json").write_text(json.dumps(evaluation))
    write_report(run)
    assert {p.stem for p in (run / "report").glob("*.png")} == RUN_PNGS | {"evaluation"}
    fig = plot_evaluation(records, evaluation)
    sampled, greedy = fig.axes[0].lines
    assert list(sampled.get_xdata()) == [0, 4, 8, 12] and list(sampled.get_ydata()) == [0.05, 0.2, 0.4, 0.6]
    assert list(greedy.get_ydata()) == [1.0] * 4
    assert plot_evaluation(records[:3], {"before": {"eval/sampled_reward": 0.1}}) is None  # an old eval.json


def test_missing_metrics_are_skipped(tmp_path):
    run = tmp_path / "sparse"
    run.mkdir()
    rows = [{"step": s, "reward": 0.5, "perf/step_s": 1.0, "perf/fwd_bwd_s": None} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(run)
    assert {p.stem for p in (run / "report").glob("*.png")} == {"reward"}
    assert len(_inline_images(page)) == 1
    assert "bottleneck" not in page.read_text()  # no config.yaml, no queue metrics


def test_series_skips_missing_and_nan():
    records = [{"step": 1, "x": 1.0}, {"step": 2, "x": None}, {"step": 3}, {"step": 4, "x": math.nan},
               {"step": 5, "x": 2}]  # fmt: skip
    assert series(records, "x") == ([1.0, 5.0], [1.0, 2.0])


def _write_sweep(sweep: Path) -> None:
    for job, (lr, slope) in enumerate([("1e-6", 0.01), ("3e-6", 0.05)]):
        run = _write_run(sweep / str(job), steps=10, slope=slope, timeline=False)
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"trainer.learning_rate={lr}", "seed=1"]))
    (sweep / "multirun.yaml").write_text("hydra: {}\n")


def test_sweep_report_compares_jobs_and_overlays_rewards(tmp_path):
    sweep = tmp_path / "multirun"
    _write_sweep(sweep)
    page = write_report(sweep)
    assert page == sweep / "report" / "index.html"
    assert (sweep / "report" / "reward_overlay.png").read_bytes().startswith(PNG_MAGIC)
    text = page.read_text()
    assert len(_inline_images(page)) == 1
    # one row per job, labelled by its overrides, with final and best reward, steps and wall time
    assert "<td>0</td><td>trainer.learning_rate=1e-6 seed=1</td><td>10</td><td>0.2000</td><td>0.2000</td>" in text
    assert "<td>1</td><td>trainer.learning_rate=3e-6 seed=1</td><td>10</td><td>0.6000</td><td>0.6000</td>" in text
    assert "<td>10 s (to the last logged step)</td>" in text  # jobs without timeline.json: an unfinished run's
    for job in ("0", "1"):
        assert (sweep / job / "report" / "index.html").is_file()
        assert f'href="../{job}/report/index.html"' in text


def test_sweep_report_keeps_a_job_page_newer_than_its_metrics_and_rewrites_a_stale_one(tmp_path):
    """Each job of a multirun writes its own page, then the sweep's: that one renders only pages left stale."""
    sweep = tmp_path / "multirun"
    _write_sweep(sweep)
    pages = [sweep / job / "report" / "index.html" for job in ("0", "1")]
    for page, metrics_ns in zip(pages, (1_000, 3_000), strict=True):  # job 1's metrics changed after its page
        page.parent.mkdir()
        page.write_text("as the job wrote it")
        os.utime(page, ns=(2_000, 2_000))
        os.utime(page.parent.parent / "metrics.jsonl", ns=(metrics_ns, metrics_ns))
    write_report(sweep)
    assert pages[0].read_text() == "as the job wrote it" and "final reward" in pages[1].read_text()


def test_empty_dir_fails_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(tmp_path)


def test_cli_report_prints_the_page_path(tmp_path):
    run = _write_run(tmp_path / "run", steps=3)
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(run / "report" / "index.html")


def test_cli_report_on_a_dir_without_metrics_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "no metrics.jsonl" in result.output


@pytest.mark.parametrize(("name", "what"), [("nope", "no such directory"), ("metrics.jsonl", "not a directory")])
def test_cli_report_on_no_directory_says_so_in_one_line(tmp_path, name, what):
    """Like every other bad input: one line and exit code 2, not Typer's five-line box."""
    run = _write_run(tmp_path / "run", steps=2)
    result = CliRunner().invoke(app, ["report", str(run / name)])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"report error: {run / name}: {what}; name a run's directory (runs/<date>_<time>) or a sweep's"
    ]


def test_the_summary_gives_the_runs_wall_time_and_its_held_out_rewards(tmp_path):
    """The wall time is timeline.json's (from the launch: the console's closing line gives it too), not the last
    step's time_s (12 s here); eval.json's held-out rewards before and after training get a row each."""
    run = _write_run(tmp_path / "run")
    timeline = json.loads((run / "timeline.json").read_text())
    timeline["summary"].update(wall_s=14.2, launch_steps=12, training_s=12.0)
    (run / "timeline.json").write_text(json.dumps(timeline))
    evaluation = {"before": {"eval/sampled_reward": 0.05, "eval/greedy_reward": 1.0}, "before_step": 0,
                  "before_model": "base model", "after": {"eval/sampled_reward": 0.6, "eval/greedy_reward": 1.0},
                  "after_step": 12}  # fmt: skip
    (run / "eval.json").write_text(json.dumps(evaluation))
    text = write_report(run).read_text()
    assert "wall time</td><td>14 s</td>" in text
    assert "held-out sampled reward</td><td>0.050 -&gt; 0.600 (base model -&gt; step 12)</td>" in text
    assert "held-out greedy reward</td><td>1.000 -&gt; 1.000 (base model -&gt; step 12)</td>" in text
    assert "timeline wall_s" not in text and "timeline training_s" not in text and "launch_steps" not in text
    timeline["summary"]["launch_steps"] = 4  # a resumed run: its last launch ran steps 9 to 12
    (run / "timeline.json").write_text(json.dumps(timeline))
    assert "wall time</td><td>14 s (the last launch: 4 of the 12 steps, resumed)</td>" in write_report(run).read_text()


def _run_figures(tmp_path: Path) -> dict[str, Figure]:
    run = _write_run(tmp_path / "run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timeline = json.loads((run / "timeline.json").read_text())
    plots = {"reward": plot_reward, "lengths": plot_lengths, "throughput": plot_throughput,
             "staleness": plot_staleness, "step_time": plot_step_time}  # fmt: skip
    return {name: plot(records) for name, plot in plots.items()} | {"timeline": plot_timeline(timeline)}


def test_legends_sit_below_the_axes_and_cover_nothing(tmp_path):
    """Inside the axes a legend hid data: the reward plot's dropped fraction (a right axis, which matplotlib's
    "best" place does not see), the lengths plot's minimum, the stacked step times."""
    for name, fig in _run_figures(tmp_path).items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert legends, name
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert box.y0 >= 0 and box.x0 >= 0 and box.x1 <= fig.bbox.width, name  # whole, in the figure
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), name  # the plotting area
                assert not box.overlaps(ax.xaxis.label.get_window_extent(renderer)), name


def test_no_label_of_a_plot_is_cut_off(tmp_path):
    for name, fig in _run_figures(tmp_path).items():
        fig.canvas.draw()  # lays the axis labels out
        for ax in fig.axes:
            box = ax.get_tightbbox(fig.canvas.get_renderer())  # what the axes draw: ticks, labels, title
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, name


def test_reward_dropped_is_drawn_only_where_groups_were_dropped(tmp_path):
    (ax, *_) = _run_figures(tmp_path)["reward"].axes
    dropped = next(line for line in ax.get_lines() if line.get_label() == "reward_dropped")
    steps, values = dropped.get_xdata(), dropped.get_ydata()
    assert list(steps) == list(range(1, 13))  # every step: the odd ones, without dropped groups, break the line
    assert [math.isnan(v) for v in values] == [step % 2 == 1 for step in steps]
