"""In-place ipc sync: the trainer's transport (weights/vllm_direct.py) against asyncrl's vLLM worker extension
(weights/vllm_extension.py) in this process, on a CPU buffer: every weight arrives through one shared buffer, the
buffer is unmapped before it goes, the trainer's gathered view is sent as a model is, and a vision-language model
sends its text model only (every transport's payload, weights/tensors.py), so the server keeps its tower, unless
model.freeze_vision_tower=false trains the tower, which is then sent too."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from asyncrl.client import ServerError
from asyncrl.config.compose import compose, to_config
from asyncrl.trainer.fsdp import GatheredModel
from asyncrl.trainer.model import load_model
from asyncrl.trainer.weight_sync import WeightSync
from asyncrl.weights.file_transport import FileTransport
from asyncrl.weights.tensors import parameter_metadata, serving_bytes, serving_parameters
from asyncrl.weights.transport import WeightSyncError
from asyncrl.weights.vllm_common import IPC_BUFFER_LIMIT
from asyncrl.weights.vllm_direct import DirectIpcTransport
from asyncrl.weights.vllm_extension import LOAD, MAP, UNMAP, WeightBufferExtension
from tests.conftest import perturb
from tests.sharded import sharded


class ServedModel(torch.nn.Module):
    """A served model with vLLM's ``load_weights(iterable of (checkpoint name, tensor))``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def load_weights(self, weights: Any) -> None:
        params = dict(self.inner.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)


class Worker(WeightBufferExtension):
    """vLLM's worker as the extension sees it: get_model() is the served model."""

    def __init__(self, served: torch.nn.Module) -> None:
        self.served = ServedModel(served)

    def get_model(self) -> torch.nn.Module:
        return self.served


class ExtensionServer:
    """A control client whose /collective_rpc calls the extension in this process; it records every call.
    Opening the buffer is what a CUDA IPC handle gives a GPU worker: the trainer's own memory."""

    base_url, timeout_s = "http://in-process", 30.0

    def __init__(self, worker: Worker, transport: DirectIpcTransport) -> None:
        self.worker, self.transport, self.calls = worker, transport, []

    def __getattr__(self, step: str) -> Any:  # pause, resume, start/finish_weight_update: recorded only
        return lambda *args, **kwargs: self.calls.append(step)

    def reopened(self, timeout_s: float) -> ExtensionServer:  # the cleanup client after a failed round
        return self

    def __enter__(self) -> ExtensionServer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def collective_rpc(self, method: str, **kwargs: str) -> list[Any]:
        self.calls.append(method)
        if method == MAP:
            self.worker._asyncrl_buffer = self.transport.buffer
            return [None]
        return [getattr(self.worker, method)(**kwargs)]


class CpuDirectTransport(DirectIpcTransport):
    def share(self, buffer: torch.Tensor) -> str:
        return "a CPU buffer has no CUDA IPC handle"


@pytest.mark.parametrize("limit", [IPC_BUFFER_LIMIT, 64 << 10])
def test_in_place_ipc_sync_loads_every_weight_through_one_buffer_without_a_vllm_session(
    limit, model, random_tiny_model_dir
):
    served = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.bfloat16)
    transport = CpuDirectTransport(torch.bfloat16, limit)
    control = ExtensionServer(Worker(served), transport)
    sync = WeightSync(control, transport)  # type: ignore[arg-type]
    sync.init(model)
    for version in (1, 2):
        perturb(model, seed=version)
        metrics = sync.push(model, version)
        for (name, trained), (_, loaded) in zip(model.named_parameters(), served.named_parameters(), strict=True):
            assert torch.equal(trained.to(torch.bfloat16), loaded), name
        buffer = transport.buffer
    assert transport.buffer is buffer and metrics["perf/weight_sync_bytes"] == serving_bytes(model, torch.bfloat16)
    loads = [LOAD] * len(transport.chunks)
    assert (len(loads) == 1) == (limit == IPC_BUFFER_LIMIT) and buffer.numel() <= max(limit, 1 << 20)
    sync.close()  # collects the last resume, then unmaps
    assert control.calls == [UNMAP, "pause", MAP, *loads, "resume", "pause", *loads, "resume", UNMAP]  # shared
    # once, no session; init released what an earlier trainer may have left mapped
    assert control.worker._asyncrl_buffer is None


def test_closing_the_in_place_ipc_sync_unmaps_before_it_drops_the_buffer(model, random_tiny_model_dir):
    """A buffer freed while the server still maps it makes torch warn at exit (benchmarks/ipc_release.py); a
    failing UNMAP still lets the trainer's buffer go."""

    held_at_unmap: list[bool] = []

    class HoldingServer(ExtensionServer):
        def collective_rpc(self, method: str, **kwargs: str) -> list[Any]:
            if method == UNMAP and self.transport.mapped:
                held_at_unmap.append(self.transport.buffer is not None)
                if len(held_at_unmap) == 2:
                    raise ServerError(503, "/collective_rpc", "the server went away")
            return super().collective_rpc(method, **kwargs)

    served = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.bfloat16)
    for _ in range(2):
        transport = CpuDirectTransport(torch.bfloat16, IPC_BUFFER_LIMIT)
        control = HoldingServer(Worker(served), transport)
        transport.stage(model)
        transport.send(control)  # type: ignore[arg-type]
        with contextlib.suppress(ServerError):
            transport.close(control)  # type: ignore[arg-type]
        assert transport.buffer is None and not transport.mapped
    assert held_at_unmap == [True, True]


def test_in_place_ipc_sync_takes_the_trainers_gathered_view(one_rank, random_tiny_model_dir):
    """A run pushes its sharded model's GatheredModel (a world of one included), which has no parameters(): the
    buffer is placed on the device of its shards."""
    config = to_config(compose([]))
    trained = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    perturb(trained, seed=1)
    expected = {name: param.detach().to(torch.bfloat16) for name, param in trained.named_parameters()}
    model, _, _ = sharded(config, trained)
    served = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.bfloat16)
    transport = CpuDirectTransport(torch.bfloat16, IPC_BUFFER_LIMIT)
    sync = WeightSync(ExtensionServer(Worker(served), transport), transport)  # type: ignore[arg-type]
    view = GatheredModel(model, one_rank, torch.bfloat16)
    sync.init(view)
    sync.push(view, version=1)
    for name, loaded in served.named_parameters():
        assert torch.equal(expected[name], loaded), name
    sync.close()


@pytest.mark.parametrize("freeze", [True, False])
def test_a_vision_language_model_sends_its_tower_only_when_it_trains_it(random_tiny_vlm_dir, tmp_path, freeze):
    """Every transport's payload (vLLM nccl/ipc: serving_parameters + parameter_metadata; the built-in server's
    file) is under the checkpoint's names, which vLLM's Qwen3.5 loader maps: the text model, so the server keeps
    its tower, and with model.freeze_vision_tower=false the trained tower too, so the server's follows it."""
    overrides = [f"model.name_or_path={random_tiny_vlm_dir}", f"model.freeze_vision_tower={freeze}"]
    model = load_model(to_config(compose(overrides)), str(random_tiny_vlm_dir))
    perturb(model, seed=1)  # the tower too: were a frozen one sent, the server's would change
    stored = load_file(random_tiny_vlm_dir / "model.safetensors")
    skipped = ("model.visual.",) if freeze else ()
    sent = {name for name, _ in model.named_parameters() if not name.startswith(skipped)}  # tied weights once
    streamed = [name for name, _ in serving_parameters(model, None)]
    assert set(streamed) == sent and [name for name, _, _ in parameter_metadata(model, None)] == streamed
    sharded = GatheredModel(model, None, None)  # type: ignore[arg-type]  # several ranks' view; metadata needs no gather
    assert [name for name, _, _ in parameter_metadata(sharded, None)] == streamed
    file = FileTransport(tmp_path)
    file.stage(model)
    assert set(load_file(str(file.path))) == sent
    file.close(None)  # type: ignore[arg-type]
    served = AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir, dtype=torch.float32)
    transport = CpuDirectTransport(None, IPC_BUFFER_LIMIT)
    WeightSync(ExtensionServer(Worker(served), transport), transport).push(model, 1)  # type: ignore[arg-type]
    for (name, trained), (_, loaded) in zip(model.named_parameters(), served.named_parameters(), strict=True):
        assert torch.equal(loaded, stored[name] if name.startswith(skipped) else trained), name


def test_in_place_ipc_sync_refuses_a_model_that_no_longer_fits_its_layout(model, random_tiny_model_dir):
    served = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.bfloat16)
    transport = CpuDirectTransport(torch.bfloat16, IPC_BUFFER_LIMIT)
    control = ExtensionServer(Worker(served), transport)
    sync = WeightSync(control, transport)  # type: ignore[arg-type]
    sync.push(model, 1)
    with pytest.raises(WeightSyncError, match="no longer match the shared weight buffer"):
        sync.push(torch.nn.Linear(3, 3), 2)
    assert control.calls[-1] == "resume"
    grown = copy.deepcopy(model)
    grown.model.norm.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))  # after every laid-out one
    with pytest.raises(WeightSyncError, match="model.norm.extra was not laid out"):
        sync.push(grown, 3)


def test_the_worker_extension_refuses_what_it_cannot_load(monkeypatch, model):
    worker = Worker(model)
    with pytest.raises(RuntimeError, match="before asyncrl_map_weight_buffer"):
        worker.asyncrl_load_weights("[]")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        worker.asyncrl_map_weight_buffer("handle")
