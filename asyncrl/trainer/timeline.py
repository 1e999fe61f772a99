"""Busy spans of generation and training, to measure how much they overlap (the point of asyncrl)."""

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
        wall = max(end - start, 1e-9)
        gen, train = self.spans.get("generation", []), self.spans.get("training", [])
        return {
            "wall_s": wall,
            "generation_busy_frac": union_length(gen) / wall,
            "training_busy_frac": union_length(train) / wall,
            "overlap_frac": overlap_length(gen, train) / wall,
        }

    def write(self, path: Path, start: float, end: float) -> dict[str, float]:
        summary = self.summary(start, end)
        path.write_text(json.dumps({"summary": summary, "spans": self.spans}, indent=1))
        return summary
