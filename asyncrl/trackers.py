"""Experiment trackers named in `logging.report_to`, driven through accelerate's tracker classes.

The trainer writes each logging step here as well as to metrics.jsonl; NaN (a metric with no event in the
window) is left out rather than plotted as a gap or a zero. With `logging.log_completions` the step's completions
go to each tracker as a table named `completions`: a wandb Table, a trackio Table, a Markdown table in TensorBoard's
text tab.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker, TensorBoardTracker, TrackioTracker, WandBTracker
from omegaconf import OmegaConf

from asyncrl.config.schema import Config
from asyncrl.rollout.images import IMAGES_COLUMN, image_count
from asyncrl.rollout.scoring import table_columns


def _tensorboard(config: Config, run_dir: Path, run_name: str) -> GeneralTracker:
    return TensorBoardTracker(run_name, run_dir / "tensorboard")


def _wandb(config: Config, run_dir: Path, run_name: str) -> GeneralTracker:
    return WandBTracker(config.logging.project, name=run_name, dir=str(run_dir), config=_plain(config))


def _trackio(config: Config, run_dir: Path, run_name: str) -> GeneralTracker:
    return TrackioTracker(config.logging.project, name=run_name, config=_plain(config))


TRACKERS: dict[str, Callable[[Config, Path, str], GeneralTracker]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "trackio": _trackio,
}


COMPLETIONS = "completions"


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard's text tab renders one): each cell's pipes escaped, its lines joined by <br>, a
    missing value shown as -."""

    def line(cells: list[Any]) -> str:
        texts = ("-" if cell is None else str(cell).replace("|", "\\|").replace("\n", "<br>") for cell in cells)
        return "| " + " | ".join(texts) + " |"

    return "\n".join([line(columns), line(["---"] * len(columns)), *map(line, rows)])


def _tensorboard_table(tracker: GeneralTracker, step: int, columns: list[str], rows: list[list[Any]]) -> None:
    tracker.log({COMPLETIONS: markdown_table(columns, rows)}, step=step)


def _wandb_table(tracker: GeneralTracker, step: int, columns: list[str], rows: list[list[Any]]) -> None:
    tracker.log_table(COMPLETIONS, columns=columns, data=rows, step=step)  # type: ignore[attr-defined]


def _trackio_table(tracker: GeneralTracker, step: int, columns: list[str], rows: list[list[Any]]) -> None:
    """trackio's Table takes its column names from a DataFrame only."""
    import trackio
    from pandas import DataFrame

    tracker.log({COMPLETIONS: trackio.Table(dataframe=DataFrame(rows, columns=columns))}, step=step)


def _wandb_image(images: list[bytes]) -> Any:
    """A row's first image as wandb shows media in a table cell (one per cell)."""
    import wandb
    from PIL import Image

    return wandb.Image(Image.open(io.BytesIO(images[0])))


IMAGE_CELLS: dict[str, Callable[[list[bytes]], Any]] = {
    "tensorboard": image_count,
    "wandb": _wandb_image,
    "trackio": image_count,
}
"""How each tracker's table shows a row's images: wandb as an image, the others (a Markdown table; trackio's
DataFrame) as a count."""

TABLES: dict[str, Callable[[GeneralTracker, int, list[str], list[list[Any]]], None]] = {
    "tensorboard": _tensorboard_table,
    "wandb": _wandb_table,
    "trackio": _trackio_table,
}
"""How each tracker of TRACKERS shows a table."""


def _plain(config: Config) -> dict[str, Any]:
    """The config as JSON-like data, so the tracker's run page shows what was trained."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def scalars(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Numbers only, NaN and None left out."""
    out: dict[str, float | int] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        out[name] = value
    return out


def first_per_prompt(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first record of each prompt, in order (TRL's ``drop_duplicates(subset=["prompt"])``)."""
    firsts: dict[Any, dict[str, Any]] = {}
    for record in records:
        firsts.setdefault(record["prompt"], record)
    return list(firsts.values())


class Trackers:
    """The started trackers of one run; empty when `logging.report_to` is empty. ``unique_prompts``:
    logging.log_unique_prompts."""

    def __init__(self, trackers: list[GeneralTracker], unique_prompts: bool = False) -> None:
        self.trackers, self.unique_prompts = trackers, unique_prompts

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = scalars(metrics)
        if not values:
            return
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def write_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """logging.log_completions' table of a logging step's completions, all of them (the console prints
        logging.num_completions_to_print), with the columns reward functions added (``log_extra``); under
        logging.log_unique_prompts only the first completion of each prompt, as TRL's table."""
        if self.unique_prompts:
            records = first_per_prompt(records)
        columns = table_columns(records)
        for tracker in self.trackers:
            show = IMAGE_CELLS[tracker.name]
            rows = [[_cell(record, column, show) for column in columns] for record in records]
            TABLES[tracker.name](tracker, step, columns, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


def _cell(record: dict[str, Any], column: str, show_images: Callable[[list[bytes]], Any]) -> Any:
    """A record's value in ``column``; its images as the tracker shows them."""
    value = record.get(column)
    return show_images(value) if column == IMAGES_COLUMN and value else value


def build_trackers(config: Config, run_dir: Path) -> Trackers:
    """Build and start every tracker in `logging.report_to`; unknown names fail before any is started."""
    names = list(config.logging.report_to)
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"logging.report_to has unknown tracker(s) {unknown} (known: {', '.join(sorted(TRACKERS))})")
    missing = [name for name in names if find_spec(name) is None]
    if missing:
        raise ImportError(f"logging.report_to={names} needs {missing} installed (pip install {' '.join(missing)})")
    run_name = config.run_name or run_dir.name
    trackers = [TRACKERS[name](config, run_dir, run_name) for name in dict.fromkeys(names)]
    for tracker in trackers:
        tracker.start()
    return Trackers(trackers, unique_prompts=config.logging.log_unique_prompts)
