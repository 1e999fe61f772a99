"""Start the rollout worker without a GPU: spawned early (it imports while the server boots), then handed its spec
once everything in it is checked to pickle."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.worker import WorkerSpec, worker_entry

# Launcher variables the worker must not inherit: it is not a rank of the trainer's process group.
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


class UnpicklableError(TypeError):
    """Something the worker needs cannot be pickled; the message names it and how to fix it."""


def check_picklable(obj: Any, label: str) -> None:
    """Raise TypeError naming ``label`` if ``obj`` cannot cross to the spawned worker."""
    try:
        pickle.dumps(obj)
    except Exception as exc:  # pickle raises PicklingError, AttributeError, TypeError...
        raise UnpicklableError(
            f"{label} cannot be sent to the rollout worker process ({type(exc).__name__}: {exc}). Everything the "
            "worker runs is pickled: use a module-level function, functools.partial, or a callable class "
            "instance defined at module level - not a lambda, closure or nested function."
        ) from exc


def check_spec(spec: WorkerSpec) -> None:
    """What prepare() has not checked (it checks the reward functions and the advantage estimator)."""
    check_picklable(spec.loop_cls, f"rollout loop class {spec.loop_cls!r} (rollout.loop_cls)")
    check_picklable(spec.tokenizer, "tokenizer")
    check_picklable(spec.dataset, "training dataset")
    check_picklable(spec.config, "config")


@contextmanager
def _worker_environment() -> Iterator[None]:
    """The spawned child inherits os.environ at start(): hide GPUs and launcher variables meanwhile."""
    saved = dict(os.environ)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for key in list(os.environ):
        if key in _DISTRIBUTED_ENV or key.startswith(("ACCELERATE_", "TORCHELASTIC_")):
            del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def spawn_worker(channels: WorkerChannels) -> mp.process.BaseProcess:
    """Start the worker process before its spec exists: it imports what it runs while the server boots, then
    waits for ``send_spec`` (and exits if the trainer stops or dies first)."""
    process = mp.get_context("spawn").Process(target=worker_entry, args=(channels, os.getpid()),
                                              name="asyncrl-rollout", daemon=True)  # fmt: skip
    with _worker_environment():
        process.start()
    return process


def send_spec(spec: WorkerSpec, channels: WorkerChannels) -> None:
    """Hand the waiting worker its spec, after checking that all of it pickles."""
    check_spec(spec)
    channels.send_spec(spec)
