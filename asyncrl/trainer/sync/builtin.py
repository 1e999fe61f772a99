"""The built-in server's transport: a safetensors file on shared memory, named in ``/update_weights``.

The file is written in ``stage``, before the server pauses, so the pause covers only the server's load.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from asyncrl.client import ControlClient
from asyncrl.config.schema import Config
from asyncrl.trainer.sync.base import Transport
from asyncrl.trainer.sync.tensors import serving_dtype, unique_state_dict

if TYPE_CHECKING:
    from asyncrl.server.checks import ServerFacts


def _staging_dir(run_dir: Path) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else run_dir
    return Path(tempfile.mkdtemp(prefix="asyncrl-weights-", dir=base))


class FileTransport(Transport):
    def __init__(self, run_dir: Path, dtype: torch.dtype | None = None) -> None:
        self.dir = _staging_dir(run_dir)
        self.dtype = dtype
        self.path: Path | None = None
        self._round = 0

    @classmethod
    def from_config(cls, *, config: Config, run_dir: Path, facts: ServerFacts | None = None) -> FileTransport:
        """The serving dtype's file transport (merged or full weights; adapter-only sync is sync/adapter.py)."""
        return cls(run_dir, serving_dtype(config))

    def init(self, control: ControlClient) -> None:
        control.init_weight_transfer({"backend": "builtin"})

    def stage(self, model: torch.nn.Module) -> None:
        self._round += 1
        self.path = self.dir / f"weights-{self._round}.safetensors"
        save_file(unique_state_dict(model, self.dtype), str(self.path))

    def send(self, control: ControlClient) -> float:
        assert self.path is not None, "stage() runs before send()"
        control.update_weights({"path": str(self.path)})
        return 0.0

    def discard(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def close(self, control: ControlClient) -> None:
        for leftover in self.dir.glob("*"):
            leftover.unlink(missing_ok=True)
        self.dir.rmdir()
