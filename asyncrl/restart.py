"""Automatic restart (trainer.max_restarts): a run whose trainer rank, rollout worker or generation server dies, or
whose weight sync or generations fail (a hung server), starts again from its newest good checkpoint instead of
exiting.

The decision is the CLI's, around the whole job (launch.py): the failed attempt's own teardown stops every process
it started (the server group's context, the trainer's close, the launcher agent's stop), then the job runs again
with trainer.resume_from_checkpoint at the newest checkpoint that ``check_checkpoint`` accepts, the usual resume
(rollout_state.json fast-forward). A newer, damaged checkpoint is renamed aside (NAME.damaged), where resume and
pruning do not see it. Before the first checkpoint the run starts again from the base model, its metrics.jsonl
moved aside into logs/ (the resume path itself drops the rows past a checkpoint's step).

torch's elastic agent keeps its own max_restarts at 0: it would restart the ranks alone, while the rollout worker,
the server and the weights it serves belong to the job. Each restart is a line on the console and a record in
logs/restarts.jsonl, whose count the trainer logs as perf/restarts. Nothing here depends on the device: a vLLM
server or a CUDA rank restarts the same way (the failed attempt's memory is released before the next starts).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("asyncrl")


def restartable_errors() -> tuple[type[BaseException], ...]:
    """A process of the run died or stopped answering: what a fresh start of the job's processes can fix (not a
    bad config, bad data or a stalled reward, which would fail again)."""
    from asyncrl.serving.process import ServerStartError
    from asyncrl.trainer.assembler import RolloutWorkerError
    from asyncrl.trainer.group_watch import GenerationFailingError
    from asyncrl.trainer.launcher import TrainerRankError
    from asyncrl.weights.transport import WeightSyncError

    return RolloutWorkerError, TrainerRankError, ServerStartError, WeightSyncError, GenerationFailingError


def resume_point(output_dir: Path) -> Path | None:
    """The newest checkpoint that resumes; each newer one that ``check_checkpoint`` refuses is renamed aside
    (NAME.damaged) with a warning. None: no checkpoint yet."""
    from asyncrl.trainer.checkpoint import ResumeError, check_checkpoint, list_checkpoints

    for path in reversed(list_checkpoints(output_dir)):
        try:
            check_checkpoint(path)
        except ResumeError as exc:
            log.warning("%s; set aside as %s.damaged", exc, path.name)
            path.rename(path.with_name(path.name + ".damaged"))
            continue
        return path
    return None


def set_aside_metrics(run_dir: Path, restart: int) -> None:
    """Before the first checkpoint: the attempt's metrics rows move to logs/, so that the new start writes steps
    1, 2, ... once (and is not refused as a run into a used directory)."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        (run_dir / "logs").mkdir(exist_ok=True)
        metrics.rename(run_dir / "logs" / f"metrics.before_restart_{restart}.jsonl")


def run_restarting(
    attempt: Callable[[str | None], None],
    run_dir: Path,
    output_dir: Path,
    max_restarts: int,
    *,
    resume: str | None = None,
    clock: Callable[[], float] = time.time,
    report: Callable[[str, BaseException], None],
) -> int:
    """Run ``attempt(resume)`` (the job, resuming from that checkpoint; ``resume`` at first) until it returns;
    after a restartable failure, up to ``max_restarts`` times, again from ``resume_point``, with
    ``report(line, failure)`` (one console line; the traceback to the log files). Past that the failure
    propagates. Returns the restarts made."""
    restarts = 0
    while True:
        try:
            attempt(resume)
            return restarts
        except restartable_errors() as exc:
            if restarts >= max_restarts:
                raise
            restarts += 1
            resume = _prepare_restart(exc, restarts, max_restarts, run_dir, output_dir, clock, report)
        _release_memory()  # the failed attempt's model and buffers, held by the traceback until here


def _prepare_restart(
    exc: BaseException,
    restart: int,
    max_restarts: int,
    run_dir: Path,
    output_dir: Path,
    clock: Callable[[], float],
    report: Callable[[str, BaseException], None],
) -> str | None:
    """Record and announce restart number ``restart`` after ``exc``; return the checkpoint it resumes from."""
    from asyncrl.trainer.checkpoint import checkpoint_step
    from asyncrl.trainer.exits import restarts_path

    checkpoint = resume_point(output_dir)
    if checkpoint is None:
        set_aside_metrics(run_dir, restart)
    first = str(exc).partition("\n")[0]
    record = {"restart": restart, "time": clock(), "error": type(exc).__name__, "message": first,
              "checkpoint": str(checkpoint) if checkpoint else None}  # fmt: skip
    path = restarts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    where = f"{checkpoint.name} (step {checkpoint_step(checkpoint)})" if checkpoint else "the start (no checkpoint yet)"
    report(f"restart {restart}/{max_restarts} ({type(exc).__name__}): {first}; resuming from {where}", exc)
    return str(checkpoint) if checkpoint else None


def _release_memory() -> None:
    """Free what the failed attempt held before the next builds its model (on a GPU: its cached blocks too)."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
