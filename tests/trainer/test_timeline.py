"""timeline.json: busy fractions of the training loop, and the run's one wall time, from its launch."""

from __future__ import annotations

import json

import pytest

from asyncrl.trainer.timeline import Timeline


def test_busy_fractions_count_only_the_training_loop():
    """The rollout worker generates during the startup too: a span before the loop counts only from its start
    (counted whole, generation was busy 125% of the loop)."""
    timeline = Timeline()
    timeline.add("generation", 95.0, 105.0)  # 5 s of it in the loop
    timeline.add("generation", 108.0, 110.0)
    timeline.add("training", 102.0, 109.0)
    summary = timeline.summary(100.0, 110.0)
    assert summary == pytest.approx({"training_s": 10.0, "generation_busy_frac": 0.7, "training_busy_frac": 0.7,
                                     "overlap_frac": 0.4})  # fmt: skip


def test_the_wall_time_counts_from_the_launch_and_is_written_with_this_launchs_steps(tmp_path):
    timeline = Timeline()
    timeline.add("training", 102.0, 109.0)
    path = tmp_path / "timeline.json"
    summary = timeline.write(path, launched=60.0, start=100.0, end=110.0, launch_steps=30)
    assert summary["wall_s"] == 50.0 and summary["training_s"] == 10.0 and summary["launch_steps"] == 30
    written = json.loads(path.read_text())
    assert written["summary"] == summary and written["start"] == 60.0
    assert written["spans"] == {"training": [[102.0, 109.0]]}
