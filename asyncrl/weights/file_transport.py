"""The built-in server's transport: a safetensors file in the server's weights directory, named in
``/update_weights``.

The file is written in ``stage``, before the server pauses, so the pause covers only the server's load. It goes
to a directory of its own under ``server.weights_dir`` (the only one the server loads from; the launcher makes
it per run, on shared memory when it can), else under the run directory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.client import Control
from asyncrl.config.schema import Config, ModelDtype
from asyncrl.dtypes import torch_dtype
from asyncrl.serving.checks import ServerFacts
from asyncrl.weights.tensors import unique_state_dict
from asyncrl.weights.transport import Transport


class FileTransport(Transport):
    def __init__(self, weights_dir: Path, dtype: torch.dtype | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="asyncrl-weights-", dir=weights_dir))
        self.dtype = dtype
        self.path: Path | None = None
        self._round = 0

    @classmethod
    def from_config(
        cls, *, config: Config, run_dir: Path, dtype: ModelDtype, facts: ServerFacts | None = None
    ) -> FileTransport:
        """The file transport of merged or full weights in ``dtype``, the plan's serving dtype (adapter-only sync is
        weights/adapter.py)."""
        return cls(Path(config.server.weights_dir or run_dir), torch_dtype(dtype))

    def init(self, control: Control, model: torch.nn.Module) -> None:
        control.init_weight_transfer({"backend": "builtin"})

    def stage(self, model: torch.nn.Module) -> None:
        self._round += 1
        self.path = self.dir / f"weights-{self._round}.safetensors"
        save_file(unique_state_dict(model, self.dtype), str(self.path))

    def send(self, control: Control) -> float:
        assert self.path is not None, "stage() runs before send()"
        control.update_weights({"path": str(self.path)})
        return 0.0

    def discard(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def close(self, control: Control) -> None:
        for leftover in self.dir.glob("*"):
            leftover.unlink(missing_ok=True)
        self.dir.rmdir()
