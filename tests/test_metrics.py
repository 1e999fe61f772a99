"""Metric window rules (spec, "Logging window")."""

import math

import pytest

from asyncrl.metrics import JsonlSink, MetricWindow, read_jsonl, reduce_events


def test_counts_are_summed_extremes_kept_others_averaged():
    assert reduce_events("sample/dropped_stale_count", [1, 2, 3]) == 6
    assert reduce_events("sample/staleness_max", [1, 4, 2]) == 4
    assert reduce_events("sampling/importance_sampling_ratio/min", [0.9, 0.5]) == 0.5
    assert reduce_events("reward", [0.0, 1.0, 0.5]) == 0.5


def test_words_not_substrings_decide():
    # "terminated" contains "min" and "max_terminated" contains both: whole words decide the rule
    assert reduce_events("completions/mean_terminated_length", [3, 24]) == 13.5
    assert reduce_events("completions/max_terminated_length", [3, 24]) == 24
    assert reduce_events("completions/min_terminated_length", [3, 24]) == 3


def test_nan_events_are_ignored_and_all_nan_is_nan():
    assert reduce_events("tools/failure_frequency", [math.nan, 1.0]) == 1.0
    assert math.isnan(reduce_events("tools/failure_frequency", [math.nan]))
    assert reduce_events("x/call_count", [math.nan]) == 0.0


def test_window_resets_after_reduce(tmp_path):
    window = MetricWindow()
    window.add("reward", 1.0)
    window.extend({"reward": [0.0], "sample/dropped_stale_count": [1, 1]})
    assert window.reduce() == {"reward": 0.5, "sample/dropped_stale_count": 2.0}
    assert window.reduce() == {}
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write(3, {"reward": 0.5, "entropy": math.nan})
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 3, "reward": 0.5, "entropy": None}]


def test_a_torn_last_line_is_skipped_with_a_warning_and_a_bad_middle_line_named(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert f"{path}:3: incomplete last line skipped" in caplog.text
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid JSON"):
        read_jsonl(path)


def test_a_resume_drops_the_rows_past_its_checkpoint_and_a_torn_last_line(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        sink.write(step, {"reward": step / 10, "entropy": math.nan})
    with sink.path.open("a") as f:
        f.write('{"step": 6, "rew')  # the interrupted run was writing step 6
    assert sink.drop_after(3) == 2
    assert read_jsonl(sink.path) == [{"step": s, "reward": s / 10, "entropy": None} for s in (1, 2, 3)]
    sink.write(4, {"reward": 1.0})
    assert [r["step"] for r in read_jsonl(sink.path)] == [1, 2, 3, 4]
    untouched = sink.path.stat().st_mtime_ns
    assert sink.drop_after(4) == 0 and sink.path.stat().st_mtime_ns == untouched  # nothing past it: not rewritten
    assert JsonlSink(tmp_path / "new" / "metrics.jsonl").drop_after(0) == 0


def test_a_resumed_sink_cuts_the_torn_last_row_before_appending(tmp_path, caplog):
    """A run out of disk (or killed) mid-row: the next launch's rows would otherwise follow the torn one, which no
    read could then skip."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    JsonlSink(path).write(2, {"reward": 0.5})
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "reward": 0.5}]
    assert "incomplete last row" in caplog.text


def test_trl_std_names_are_the_spread_of_their_events_and_other_std_words_stay_means():
    assert reduce_events("reward_std", [0.0, 0.0, 1.0, 1.0]) == pytest.approx(0.57735, rel=1e-4)  # Bessel's, as TRL
    assert reduce_events("rewards/accuracy/std", [0.0, math.nan, 2.0]) == pytest.approx(1.41421, rel=1e-4)
    assert math.isnan(reduce_events("reward_std", [1.0]))
    for name in ("frac_reward_zero_std", "reward_group_std", "rewards/accuracy/group_std"):
        assert reduce_events(name, [0.0, 1.0]) == 0.5
