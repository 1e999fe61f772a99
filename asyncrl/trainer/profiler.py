"""Opt-in torch.profiler capture of chosen optimizer steps (``logging.profile_steps``).

A slow run's first question is where a step's time goes, kernel by kernel; this answers it from the run itself,
with no external tool: each chosen step leaves a Chrome trace (open in Perfetto) and a table of the most
expensive operators under ``<run_dir>/profile/``. The step's phases are labelled (``asyncrl/...`` ranges), so
the trace shows rollout waiting, forward, backward, optimizer and weight sync side by side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger("asyncrl.trainer")

TABLE_ROWS = 30


def phase(name: str) -> Any:
    """A labelled range in a profiled step's trace; costs nothing measurable when no profiler runs."""
    return record_function(f"asyncrl/{name}")


@contextmanager
def profiled_step(step: int, steps: Sequence[int], out_dir: Path) -> Iterator[None]:
    """Profile optimizer step ``step`` (1-based) if it is one of ``steps``; else do nothing."""
    if step not in steps:
        yield
        return
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()  # the step's kernels belong to its trace, not the next step's
    write_profile(prof, step, out_dir, "self_device_time_total" if cuda else "self_cpu_time_total")


def write_profile(prof: profile, step: int, out_dir: Path, sort_by: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    trace, table = out_dir / f"step_{step}.trace.json", out_dir / f"step_{step}.txt"
    prof.export_chrome_trace(str(trace))
    table.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
    log.info("profiled step %d: %s (operators by %s) and %s", step, table, sort_by, trace)


def wait_for_device() -> None:
    """CUDA kernels run asynchronously: a phase's wall time is its own only once its kernels have finished."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
