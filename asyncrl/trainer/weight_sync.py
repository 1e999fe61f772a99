"""Weight sync backends: push the trainer's weights to the generation server.

Every backend runs vLLM's dev-mode sequence (pause -> start -> update -> finish -> resume) so the
trainer's code path is the same for every server; only the transport differs. The built-in server's
transport is a safetensors file the trainer writes *before* pausing (so the pause only covers loading),
named in ``/update_weights``. Every HTTP call is checked and timed out; on failure the server is resumed
(best effort) and the error names the step that failed.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.client import ControlClient


class WeightSyncError(RuntimeError):
    """A weight-sync step failed; the message names it."""


def _staging_dir(run_dir: Path) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else run_dir
    return Path(tempfile.mkdtemp(prefix="asyncrl-weights-", dir=base))


def unique_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, each storage once (tied weights travel under their first name)."""
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        t = tensor.detach()
        tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
    return tensors


class BuiltinWeightSync:
    """Transport for the built-in server: a safetensors file on shared memory (or the run directory)."""

    def __init__(self, control: ControlClient, run_dir: Path, dtype: torch.dtype | None = None) -> None:
        self.control = control
        self.dir = _staging_dir(run_dir)
        self.dtype = dtype

    def init(self) -> None:
        self._call("init", self.control.init_weight_transfer, {"backend": "builtin"})

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        started = time.perf_counter()
        path = self.dir / f"weights-v{version}.safetensors"
        save_file(unique_state_dict(model, self.dtype), str(path))
        staged = time.perf_counter()
        self._call("pause", self.control.pause, "keep", True)
        paused = time.perf_counter()
        try:
            self._call("start_weight_update", self.control.start_weight_update)
            self._call("update_weights", self.control.update_weights, {"path": str(path)})
            self._call("finish_weight_update", self.control.finish_weight_update, str(version))
        finally:
            path.unlink(missing_ok=True)
            self._call("resume", self.control.resume)
        done = time.perf_counter()
        return {
            "perf/weight_sync_s": done - started,
            "perf/weight_sync_gather_s": staged - started,
            "perf/weight_sync_pause_s": paused - staged,
            "perf/weight_sync_barrier_s": 0.0,
            "perf/weight_sync_transfer_s": done - paused,
        }

    def close(self) -> None:
        for leftover in self.dir.glob("*"):
            leftover.unlink(missing_ok=True)
        self.dir.rmdir()

    @staticmethod
    def _call(step: str, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except Exception as exc:
            raise WeightSyncError(f"weight sync failed at {step}: {exc}") from exc
