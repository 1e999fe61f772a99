"""Weight updates for the built-in server, following vLLM's dev-mode sequence over a file transport.

init -> (pause) -> start -> update x N -> finish -> (resume). Each update loads named tensors (state_dict
names, any subset) from a safetensors file the trainer wrote, into the engine's own model, while the
engine is paused and its step lock is held. A failed update ends the session, as in vLLM; all names and
shapes are checked before any tensor is copied, so a rejected file leaves the weights untouched.

Files (and LoRA adapter directories) load only from the directory given at server start (``--weights-dir``, the
run's transfer directory when the CLI launches the server). Every other path (outside it, missing, of the wrong
kind, or a symlink leading out of it) is refused with one and the same message, which does not echo the path,
so the answers reveal nothing about the rest of the file system.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from safetensors import safe_open

from asyncrl.engine.core import Engine
from asyncrl.engine.lora import AdapterNotFound, base_state_dict


class WeightsDir:
    """The one directory the server reads weights and adapters from; None: a server that loads none."""

    def __init__(self, root: Path | None) -> None:
        self.root = None if root is None else root.resolve()

    def _inside(self, path: object, kind: str) -> Path | None:
        """``path`` resolved (symlinks followed; relative to the root) if it is a ``kind`` under the root."""
        if self.root is None or not isinstance(path, str) or not path or "\0" in path:
            return None
        try:
            resolved = (self.root / path).resolve()
        except (OSError, RuntimeError):  # a symlink loop
            return None
        if not resolved.is_relative_to(self.root):
            return None
        if not (resolved.is_file() if kind == "file" else resolved.is_dir()):
            return None
        return resolved

    def _refusal(self, kind: str) -> str:
        """The one reason given for every refused path."""
        if self.root is None:
            return f"this server was started without --weights-dir, so it loads no {kind}"
        return f"the server loads {kind} only from inside its --weights-dir {self.root}"

    def file(self, path: object) -> Path:
        """A weights file to read; ValueError (HTTP 400) for every other path, with one message."""
        resolved = self._inside(path, "file")
        if resolved is None:
            raise ValueError(f"update_info.path is refused: {self._refusal('weight files')}")
        return resolved

    def adapter(self, name: str, path: object) -> Path:
        """An adapter directory whose files all lie under the root; AdapterNotFound (vLLM's 404) otherwise."""
        resolved = self._inside(path, "directory")
        if resolved is None or any(self._inside(str(f), "file") is None for f in resolved.iterdir() if f.is_file()):
            raise AdapterNotFound(
                f"Loading lora {name} failed: No adapter found at lora_path: {self._refusal('adapter directories')}"
            )
        return resolved


class WeightUpdater:
    """The weight update session state of one server."""

    def __init__(self, engine: Engine, allowed: WeightsDir) -> None:
        self._engine = engine
        self._allowed = allowed
        self._lock = threading.Lock()
        self._init_info: dict[str, Any] | None = None
        self._active = False
        self.version = "default"

    def init(self, init_info: dict[str, Any]) -> None:
        """The built-in transport needs no rendezvous: record that the trainer initialised it."""
        with self._lock:
            self._init_info = dict(init_info)

    def start(self) -> None:
        with self._lock:
            if self._init_info is None:
                raise ValueError("init_weight_transfer_engine must be called before start_weight_update")
            if not self._engine.is_paused:
                raise ValueError("start_weight_update needs a paused server: POST /pause first")
            if self._active:
                raise ValueError("start_weight_update called while a weight update is already active")
            self._active = True

    def update(self, update_info: dict[str, Any]) -> list[str]:
        """Load every tensor of ``update_info["path"]``; return the names loaded. Errors end the session."""
        with self._lock:
            if not self._active:
                raise ValueError("start_weight_update must be called before update_weights")
            try:
                return self._load(update_info)
            except Exception:
                self._active = False
                raise

    def finish(self, weight_version: str | None) -> None:
        with self._lock:
            if not self._active:
                raise ValueError("finish_weight_update called without an active weight update (start_weight_update)")
            self._active = False
            if weight_version is not None:
                self.version = weight_version

    def _load(self, update_info: dict[str, Any]) -> list[str]:
        path = str(self._allowed.file(update_info.get("path")))
        with self._engine.paused_model() as model:
            state = base_state_dict(model)  # the base names, also while LoRA adapters wrap the layers
            device = next(model.parameters()).device
            try:
                handle = safe_open(path, framework="pt", device=str(device))
            except Exception as error:  # the file's content is the client's mistake: report it as such
                raise ValueError(f"update_info.path {path!r} is not a readable safetensors file: {error}") from error
            with handle as tensors:
                names = list(tensors.keys())
                for name in names:
                    if name not in state:
                        raise ValueError(f"update_weights: tensor {name!r} is not a parameter of the served model")
                    shape = tuple(tensors.get_slice(name).get_shape())
                    if shape != tuple(state[name].shape):
                        raise ValueError(
                            f"update_weights: tensor {name!r} has shape {list(shape)}, "
                            f"the model expects {list(state[name].shape)}"
                        )
                for name in names:
                    state[name].copy_(tensors.get_tensor(name))
        return names
