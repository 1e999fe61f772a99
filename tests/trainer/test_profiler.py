"""The opt-in step profiler: only the chosen steps leave a trace and an operator table."""

from __future__ import annotations

import json

import torch

from asyncrl.trainer.profiler import phase, profiled_step


def work() -> None:
    with phase("forward"):
        torch.randn(64, 64) @ torch.randn(64, 64)


def test_only_chosen_steps_are_written(tmp_path):
    for step in (1, 2, 3):
        with profiled_step(step, [2], tmp_path):
            work()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2.trace.json", "step_2.txt"]


def test_the_trace_holds_the_labelled_phase_and_the_table_its_operators(tmp_path):
    with profiled_step(1, [1], tmp_path):
        work()
    events = json.loads((tmp_path / "step_1.trace.json").read_text())["traceEvents"]
    assert "asyncrl/forward" in {e.get("name") for e in events}
    assert "aten::mm" in (tmp_path / "step_1.txt").read_text()
