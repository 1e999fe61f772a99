"""Metric windows and sinks.

A window collects events since the last log. Reduction follows the spec: a name whose last part
has the word ``count`` is summed, one with ``max``/``min`` keeps the extreme, one in ``SPREAD_NAMES`` is the
standard deviation of its events, anything else is the mean of its events (NaN events are ignored; a window with
only NaN gives NaN). Sinks: ``metrics.jsonl`` in the run directory (one object per logging step) and accelerate
trackers (tensorboard, wandb, trackio) when configured.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SPREAD_NAMES = ("std", "reward_std")
"""Last name parts reduced to the sample standard deviation of their events (NaN below two): TRL's ``reward_std``
and ``rewards/<fn>/std``, the spread of the rewards across the window's completions. Whole names, so that
``frac_reward_zero_std`` and ``reward_group_std`` (per-group figures) stay means."""


def reduce_events(name: str, values: list[float]) -> float:
    """Reduce one metric's window by the words of its last name part (``mean_terminated_length`` is a mean)."""
    last = name.rsplit("/", 1)[-1]
    words = last.split("_")
    finite = [v for v in values if not math.isnan(v)]
    if "count" in words:
        return float(sum(finite))
    if last in SPREAD_NAMES:
        return statistics.stdev(finite) if len(finite) > 1 else math.nan
    if not finite:
        return math.nan
    if "max" in words:
        return float(max(finite))
    if "min" in words:
        return float(min(finite))
    return float(sum(finite) / len(finite))


class MetricWindow:
    """Events recorded since the last log."""

    def __init__(self) -> None:
        self._events: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, value: float) -> None:
        self._events[name].append(float(value))

    def extend(self, events: Mapping[str, Iterable[float]]) -> None:
        for name, values in events.items():
            self._events[name].extend(float(v) for v in values)

    def update(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.add(name, value)

    def reduce(self) -> dict[str, float]:
        """Reduce every metric and start a new window."""
        out = {name: reduce_events(name, values) for name, values in sorted(self._events.items()) if values}
        self._events = defaultdict(list)
        return out


class JsonlSink:
    """Appends one JSON object per logging step; NaN is written as null."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_row(path)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        finite = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
        record = {"step": step, **finite}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def drop_after(self, step: int) -> int:
        """Drop the records past ``step`` (those an interrupted run logged after the checkpoint a resumed run
        continues from), replacing the file atomically; returns how many were dropped."""
        if not self.path.is_file():
            return 0
        records = read_jsonl(self.path)  # a last line cut short is dropped too: the next record would extend it
        kept = [record for record in records if record["step"] <= step]
        text = "".join(json.dumps(record) + "\n" for record in kept)
        if text != self.path.read_text():
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)
        return len(records) - len(kept)


def drop_partial_row(path: Path) -> None:
    """Cut a last row left incomplete (a run killed or out of disk while writing it) before rows are appended
    after it, where every later read would fail on it."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        content = f.read()
        f.truncate(content.rfind(b"\n") + 1)
        log.warning("%s: an incomplete last row (the run stopped while writing it) removed", path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file. A last line cut short (a run killed mid-write) is skipped with a warning;
    an unreadable line before it is an error naming the file and the line."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg}); fix or remove that line") from exc
            log.warning("%s:%d: incomplete last line skipped (the run was stopped while writing it)", path, number)
    return records
