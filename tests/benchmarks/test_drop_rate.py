"""benchmarks/drop_rate.py: a run's figures leave its start-up out, and a run stopped at its limit still counts."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType


def rows(step_s: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, "perf/step_s": s, "perf/rollout_wait_s": s / 2} for i, s in enumerate(step_s)]


def test_the_medians_leave_out_the_first_steps_and_a_metric_no_step_logged_is_nan(drop_rate: ModuleType) -> None:
    figures = drop_rate.summary(rows([30.0, 9.0, 1.0, 2.0, 3.0]), skip=2)
    assert (figures["steps"], figures["measured_steps"]) == (5, 3)
    assert (figures["step_s"], figures["rollout_wait_s"]) == (2.0, 1.0)
    assert math.isnan(figures["worker_cpu"])


def test_a_run_stopped_at_its_limit_says_so_beside_its_ratio_to_the_first(drop_rate: ModuleType) -> None:
    whole = {"drop_fraction": 0.0, "cut": False, **drop_rate.summary(rows([5.0, 1.0, 1.0]), skip=1)}
    cut = {"drop_fraction": 0.7, "cut": True, **drop_rate.summary(rows([5.0, 3.0]), skip=1)}
    assert "cut at" not in drop_rate.line(whole, whole["step_s"])
    assert "1 steps measured, cut at 2 steps): 3.000 s/step (3.00x)" in drop_rate.line(cut, whole["step_s"])


def test_a_real_runs_steps_are_binned_by_the_share_dropped_and_unlogged_shares_left_out(drop_rate: ModuleType) -> None:
    logged = [(0.0, 9.0), (0.1, 1.0), (0.35, 3.0), (0.5, 50.0), (0.7, 2.0), (0.9, 4.0), (1.0, 9.0), (None, 70.0)]
    steps = [{"step": i + 1, "perf/step_s": s, **({} if f is None else {"frac_reward_zero_std": f})}
             for i, (f, s) in enumerate(logged)]  # fmt: skip
    figures = drop_rate.by_drop_rate(steps, skip=1)  # the first step (9 s, start-up) and the unlogged 70 s are out
    assert figures["low"] == {"steps": 2, "median_s": 2.0, "mean_s": 2.0}
    assert figures["high"] == {"steps": 3, "median_s": 4.0, "mean_s": 5.0}
    assert (figures["median_ratio"], figures["mean_ratio"]) == (2.0, 2.5)
    assert "2 steps at <= 35% dropped 2.000 s/step median" in drop_rate.drop_rate_line(Path("m"), figures)


def test_a_run_without_low_steps_has_no_ratio(drop_rate: ModuleType) -> None:
    figures = drop_rate.by_drop_rate([{"step": 1, "perf/step_s": 1.0, "frac_reward_zero_std": 0.9}], skip=0)
    assert figures["low"]["steps"] == 0 and math.isnan(figures["median_ratio"])
