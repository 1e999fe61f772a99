"""benchmarks/drop_rate.py: a run's figures leave its start-up out, and a run stopped at its limit still counts."""

from __future__ import annotations

import math
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
