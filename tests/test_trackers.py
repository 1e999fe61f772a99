"""Trackers: metrics and logging.log_completions' table reach tensorboard's event file (read back and rendered with
tensorboard itself) and wandb's and trackio's tables; bad names fail early."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
from accelerate.tracking import TrackioTracker, WandBTracker
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugin_util import markdown_to_safe_html

from asyncrl.config.schema import Config
from asyncrl.trackers import Trackers, build_trackers, scalars


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


RECORDS = [  # rollout/group_metrics.py's rows; a reward function's log_extra column on the first only
    {"prompt": "2+2?", "completion": "4 | four\nfinal", "reward": 1.0, "advantage": 0.5, "judge": "ok"},
    {"prompt": "3+3?", "completion": "7", "reward": 0.0, "advantage": -0.5},
]
COLUMNS = ["prompt", "completion", "reward", "advantage", "judge"]
ROWS = [["2+2?", "4 | four\nfinal", 1.0, 0.5, "ok"], ["3+3?", "7", 0.0, -0.5, None]]


def test_completions_reach_tensorboards_text_tab_as_a_table(tmp_path):
    trackers = build_trackers(_config(["tensorboard"]), tmp_path)
    trackers.write_completions(3, RECORDS)
    trackers.close()

    events = EventAccumulator(str(tmp_path / "tensorboard" / "tb-run"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("completions/text_summary")
    html = markdown_to_safe_html(event.tensor_proto.string_val[0])  # as the text tab renders it
    assert event.step == 3 and html.count("<tr>") == 3 and all(f"<th>{c}</th>" in html for c in COLUMNS)
    assert "<td>4 | four<br>final</td>" in html and "<td>-0.5</td>\n<td>-</td>" in html


class FakeRun:
    """The run object wandb.init and trackio.init return: what was logged."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))


def test_completions_reach_wandb_and_trackio_as_their_tables(monkeypatch):
    """Through accelerate's trackers, on stand-ins for the two packages (not installed here): a wandb.Table of the
    columns and rows, and a trackio.Table built from a DataFrame (its only way to take column names)."""
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(Table=lambda **table: ("wandb.Table", table)))
    monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(Table=lambda **table: ("trackio.Table", table)))
    wandb, trackio = WandBTracker("run"), TrackioTracker("project")
    wandb.run, trackio.run = FakeRun(), FakeRun()
    Trackers([wandb, trackio]).write_completions(3, RECORDS)
    ((logged, step),) = wandb.run.logged
    assert step == 3 and logged["completions"] == ("wandb.Table", {"columns": COLUMNS, "data": ROWS, "dataframe": None})
    ((logged, step),) = trackio.run.logged
    kind, table = logged["completions"]
    frame = table["dataframe"]
    assert step == 3 and kind == "trackio.Table" and list(frame.columns) == COLUMNS
    assert frame.astype(object).where(frame.notna(), None).values.tolist() == ROWS  # pandas reads None as NaN


def test_unique_prompts_keep_the_first_completion_of_each_prompt_in_the_table(tmp_path):
    """logging.log_unique_prompts, as TRL's drop_duplicates(subset=["prompt"]): order kept, later repeats dropped."""
    config = _config(["tensorboard"])
    config.logging.log_completions = config.logging.log_unique_prompts = True
    trackers = build_trackers(config, tmp_path)
    trackers.write_completions(3, [RECORDS[0], RECORDS[1], {**RECORDS[0], "completion": "five"}])
    trackers.close()

    events = EventAccumulator(str(tmp_path / "tensorboard" / "tb-run"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("completions/text_summary")
    html = markdown_to_safe_html(event.tensor_proto.string_val[0])
    assert html.count("<tr>") == 3 and html.index("2+2?") < html.index("3+3?") and "five" not in html


def test_a_rows_images_reach_wandb_as_an_image_and_the_text_tables_as_a_count(tmp_path, monkeypatch):
    """logging.log_multimodal's thumbnails: a wandb.Image of the first (one medium a cell), and "N images" where the
    table is text (TensorBoard's Markdown, trackio's DataFrame)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 4), "blue").save(buffer, format="PNG")
    records = [{**RECORDS[0], "images": [buffer.getvalue(), buffer.getvalue()]}, RECORDS[1]]
    wandb_module = SimpleNamespace(Table=lambda **table: table, Image=lambda image: ("wandb.Image", image.size))
    monkeypatch.setitem(sys.modules, "wandb", wandb_module)
    monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(Table=lambda **table: table))
    wandb, trackio = WandBTracker("run"), TrackioTracker("project")
    wandb.run, trackio.run = FakeRun(), FakeRun()
    Trackers([wandb, trackio]).write_completions(3, records)
    ((logged, _),) = wandb.run.logged
    assert [row[-1] for row in logged["completions"]["data"]] == [("wandb.Image", (8, 4)), None]
    ((logged, _),) = trackio.run.logged
    assert logged["completions"]["dataframe"]["images"].tolist()[0] == "2 images"
