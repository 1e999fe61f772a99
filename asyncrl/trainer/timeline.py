"""Busy spans of generation and training, to measure how much they overlap (the point of asyncrl), and the run's
wall time (timeline.json)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def union_length(spans: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in merge(spans))


def clip(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of ``spans`` between ``start`` and ``end``."""
    return [(max(s, start), min(e, end)) for s, e in spans if e > start and s < end]


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which both span sets are busy."""
    total = 0.0
    for s1, e1 in merge(a):
        for s2, e2 in merge(b):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


class Timeline:
    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def add(self, name: str, start: float, end: float) -> None:
        self.spans[name].append((start, end))

    def summary(self, start: float, end: float) -> dict[str, float]:
        """Busy fractions of the training loop, ``start`` to ``end`` (training_s): spans are clipped to it, since the
        rollout worker generates during the startup too."""
        window = max(end - start, 1e-9)
        gen, train = (clip(self.spans.get(name, []), start, end) for name in ("generation", "training"))
        return {
            "training_s": window,
            "generation_busy_frac": union_length(gen) / window,
            "training_busy_frac": union_length(train) / window,
            "overlap_frac": overlap_length(gen, train) / window,
        }

    def write(self, path: Path, launched: float, start: float, end: float, launch_steps: int) -> dict[str, float]:
        """timeline.json: the spans and their summary, which holds the run's wall time, ``wall_s``: from the job's
        launch (``launched``: launch.py's ASYNCRL_STARTED_AT, where perf/startup_* count from; a resumed run counts
        from its own launch, whose steps are ``launch_steps``) to the end of training (``end``: the final model
        saved). It is the one wall time: the console's closing line and the report's summary give it too. The busy
        fractions are of the training loop (``summary``)."""
        summary = {"wall_s": end - launched, "launch_steps": launch_steps, **self.summary(start, end)}
        path.write_text(json.dumps({"summary": summary, "start": launched, "spans": self.spans}, indent=1))
        return summary
