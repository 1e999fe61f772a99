"""Trackers: metrics reach tensorboard's event file (read back with tensorboard itself); bad names fail early."""

from __future__ import annotations

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.config.schema import Config
from asyncrl.trackers import build_trackers, scalars


def _config(report_to: list[str]) -> Config:
    config = Config()
    config.logging.report_to = report_to
    config.run_name = "tb-run"
    return config


def test_tensorboard_event_file_holds_the_logged_scalars(tmp_path):
    trackers = build_trackers(_config(["tensorboard"]), tmp_path)
    trackers.write(1, {"reward": 0.25, "perf/step_s": 1.5, "reward_dropped": math.nan})
    trackers.write(2, {"reward": 0.75, "perf/step_s": 1.25, "reward_dropped": 1.0})
    trackers.close()

    events = EventAccumulator(str(tmp_path / "tensorboard" / "tb-run"))
    events.Reload()
    reward = [(e.step, e.value) for e in events.Scalars("reward")]
    assert reward == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("perf/step_s")] == [(1, 1.5), (2, 1.25)]
    # the NaN of step 1 was skipped, so only step 2 is there
    assert [(e.step, e.value) for e in events.Scalars("reward_dropped")] == [(2, 1.0)]


def test_unknown_tracker_names_logging_report_to(tmp_path):
    with pytest.raises(ValueError, match=r"logging\.report_to.*'tensorbord'"):
        build_trackers(_config(["tensorbord"]), tmp_path)
    assert not (tmp_path / "tensorboard").exists()


def test_tracker_package_not_installed_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr("asyncrl.trackers.find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(ImportError, match=r"logging\.report_to.*pip install wandb"):
        build_trackers(_config(["tensorboard", "wandb"]), tmp_path)
    assert not (tmp_path / "tensorboard").exists()


def test_no_trackers_write_nothing(tmp_path):
    trackers = build_trackers(_config([]), tmp_path)
    trackers.write(1, {"reward": 1.0})
    trackers.close()
    assert list(tmp_path.iterdir()) == []


def test_scalars_keep_numbers_only():
    assert scalars({"a": 1, "b": 0.5, "c": math.nan, "d": None, "e": "text", "f": True}) == {"a": 1, "b": 0.5}
