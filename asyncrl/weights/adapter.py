"""Adapter-only weight sync: each policy version's LoRA adapter is written to disk and loaded under a new name.

vLLM and the built-in server load adapters from a path (``POST /v1/load_lora_adapter``), so every sync writes the
adapter (peft's format: ``adapter_config.json`` and the adapter tensors only, in the serving dtype) to
``<dir>/.vllm_lora/<prefix>-v<version>/`` (``dir``: server.weights_dir, else the output directory) through a
temporary directory and a rename, then loads it under that same new name: vLLM keys its prefix cache by adapter
name and does not clear it when a path is reloaded. Requests select a version with ``model=<prefix>-v<version>``
(``client.policy_model``; version 0 is the base model itself). ``max_staleness + 1`` versions stay registered, so a
rollout that started under an older policy finishes under it; the next version is loaded before the oldest is
unloaded, so ``--max-loras`` must be at least ``max_staleness + 2``. A version's files are deleted one sync after
it is unloaded, since vLLM may re-read them for requests still running under it. No pause is needed: adapters load
beside running requests.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import torch

from asyncrl import lora
from asyncrl.client import Control, policy_model
from asyncrl.config.schema import Config, ModelDtype
from asyncrl.dtypes import torch_dtype
from asyncrl.flow import FlowControl
from asyncrl.serving.command import served_model_name
from asyncrl.weights.tensors import whole_tensors
from asyncrl.weights.transport import WeightSyncError, run_step

log = logging.getLogger(__name__)

CACHE_DIR = ".vllm_lora"


def write_adapter(model: Any, path: Path, dtype: torch.dtype | None) -> int:
    """Write the adapter of ``model`` (a peft model, or the sharded view of one) to ``path`` in ``dtype``,
    atomically (a sibling temporary directory, then a rename); its bytes."""
    inner, full = whole_tensors(getattr(model, "module", model))
    if not lora.is_peft(inner):
        raise WeightSyncError(f"lora.sync=adapter needs the trainer's peft model, got {type(inner).__name__}")
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    tensors = {name: cast(full(name)).cpu() for name, param in inner.named_parameters() if param.requires_grad}
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    lora.save_adapter(inner, tensors, staging)
    size = sum(f.stat().st_size for f in staging.iterdir())
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)
    return size


class AdapterSync:
    """``WeightSync``'s interface (init, push, close) for adapter-only sync; ``adapter_prefix`` names versions."""

    adapter_only = True

    def __init__(
        self,
        control: Control,
        config: Config,
        output_dir: Path,
        facts: Any = None,
        *,
        flow: FlowControl,
        dtype: ModelDtype,
    ) -> None:
        """``flow`` and ``dtype``: the run plan's flow rules and serving dtype."""
        self.control, self.facts = control, facts
        self.base_name = served_model_name(config)
        self.adapter_prefix = f"asyncrl-{uuid.uuid4().hex[:8]}"  # fresh per run: no clash with a server's leftovers
        self.root = output_dir / CACHE_DIR
        self.dtype = torch_dtype(dtype)
        self.keep = flow.live_versions
        self.registered: deque[int] = deque()
        self.unloaded: list[int] = []

    def name(self, version: int) -> str:
        return policy_model(self.base_name, self.adapter_prefix, version)

    def path(self, version: int) -> Path:
        return self.root / self.name(version)

    def init(self, model: torch.nn.Module) -> None:
        """The adapter's versions go under ``root``; nothing is planned from ``model`` (each push writes it whole)."""
        self.root.mkdir(parents=True, exist_ok=True)

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Write and load ``version``; unload what leaves the window, delete what left it at the last sync."""
        started = time.perf_counter()
        if version == 0:  # version 0 is served as the base model (policy_model): nothing to load
            return {"perf/weight_sync_s": 0.0, "perf/weight_sync_bytes": 0.0}
        size = run_step("write adapter", write_adapter, model, self.path(version), self.dtype)
        try:
            run_step("load_lora_adapter", self.control.load_lora_adapter, self.name(version), str(self.path(version)))
        except WeightSyncError:
            self._delete([version])
            raise
        self.registered.append(version)
        self._delete(self.unloaded)
        self.unloaded = []
        while len(self.registered) > self.keep:
            oldest = self.registered.popleft()
            run_step("unload_lora_adapter", self.control.unload_lora_adapter, self.name(oldest))
            self.unloaded.append(oldest)
        return {"perf/weight_sync_s": time.perf_counter() - started, "perf/weight_sync_bytes": float(size)}

    def check(self) -> None:
        """Nothing of a push is left running (``WeightSync.check``'s counterpart: adapters load without a pause)."""

    def settle(self) -> None:
        """Nothing to wait for (``WeightSync.settle``'s counterpart): the server never paused."""

    def _delete(self, versions: list[int]) -> None:
        for version in versions:
            shutil.rmtree(self.path(version), ignore_errors=True)

    def close(self) -> None:
        """Unload this run's adapters (best effort: the server may be gone) and delete their files."""
        for version in self.registered:
            try:
                self.control.unload_lora_adapter(self.name(version))
            except Exception as error:  # noqa: BLE001 - the end of the run must not fail on cleanup
                log.info("unloading adapter %s at the end of the run: %s", self.name(version), error)
        self._delete([*self.registered, *self.unloaded])
        self.registered.clear()
        self.unloaded = []
        if self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()
