"""Weight sync rounds against the built-in server: weights arrive, and a failure at any step is an error
(no hang) that leaves the server resumed and ready for the next round; a server that hangs or dies mid-round ends
it naming the server. Plus the vLLM transports' pure parts, and a vision-language model's payload: its text model
only, so the server keeps the vision tower it loaded."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
import os
import pickle
import re
import signal
import sys
import threading
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from asyncrl.client import ControlClient, GenerationClient, SamplingParams, ServerError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import ModelDtype
from asyncrl.control_group import ControlGroup
from asyncrl.plan.assemble import build_plan, plan_run
from asyncrl.serving.checks import ServerFacts
from asyncrl.serving.command import LAUNCHED_VLLM_MERGES, served_name
from asyncrl.serving.group import ServerGroup
from asyncrl.serving.process import ServerProcess, ServerStartError
from asyncrl.serving.vllm import WORKER_EXTENSION
from asyncrl.serving.watchdog import ServerWatch
from asyncrl.trainer.fsdp import GatheredModel
from asyncrl.trainer.model import load_model
from asyncrl.trainer.weight_sync import (
    WEIGHT_SYNC,
    WeightSync,
    WeightSyncError,
    build_weight_sync,
    syncs_adapters,
)
from asyncrl.weights.file_transport import FileTransport
from asyncrl.weights.tensors import parameter_metadata, serving_bytes, serving_parameters
from asyncrl.weights.transport import Background
from asyncrl.weights.vllm_common import IPC_BUFFER_LIMIT, ipc_buffer_bytes, ipc_json, run_watched
from asyncrl.weights.vllm_direct import DirectIpcTransport
from asyncrl.weights.vllm_extension import LOAD, MAP, UNMAP, WeightBufferExtension
from asyncrl.weights.vllm_factory import FactoryTransport, RoundClient, serving_source
from asyncrl.weights.vllm_transports import ipc_transport, nccl_transport
from tests.conftest import serve_session
from tests.sharded import sharded

STEPS = ("stage", "pause", "start_weight_update", "update_weights", "finish_weight_update", "resume")

BF16 = ModelDtype.bfloat16
"""The serving dtype the transport tests send in (a run's plan decides it)."""


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture
def model(random_tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def served_vs_local(base_url: str, model: torch.nn.Module, name: str) -> float:
    """Max |server logprob - local logprob| over a sampled completion (temperature 1: processed = raw)."""
    prompt = [4, 30, 31, 32, 5]

    async def generate():
        async with GenerationClient(base_url, name, timeout_s=60) as client:
            return await client.complete(prompt, SamplingParams(max_tokens=12, logprobs=0, seed=3))

    out = asyncio.run(generate())
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    local = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    return float((local - torch.tensor(out.logprobs)).abs().max())


def test_a_round_moves_the_weights_and_reports_its_parts(server, model, random_tiny_model_dir, tmp_path):
    name = served_name(str(random_tiny_model_dir))
    perturb(model, seed=1)
    with ControlClient(server.base_url, timeout_s=60) as control:
        sync = WeightSync(control, FileTransport(tmp_path))
        sync.init(model)
        before = served_vs_local(server.base_url, model, name)
        metrics = sync.push(model, 1)
        after = served_vs_local(server.base_url, model, name)  # queued until the resume lands, if it has not
        sync.settle()
        assert control.weight_version() == "1" and not control.is_paused()
        paused = sync.push(model, 2)["perf/generation_paused_s"]  # the round before's, known once it resumed
        sync.close()
    assert before > 1e-2 and after < 1e-4, (before, after)
    parts = ("stage", "pause", "barrier", "transfer")
    assert metrics["perf/weight_sync_s"] == pytest.approx(sum(metrics[f"perf/weight_sync_{p}_s"] for p in parts))
    assert all(metrics[f"perf/weight_sync_{p}_s"] >= 0 for p in parts) and not any(tmp_path.glob("asyncrl-weights-*/*"))
    assert paused >= metrics["perf/weight_sync_transfer_s"]


class FailingControl(ControlClient):
    """A ControlClient that fails one step: the server refuses the update, or the call itself breaks."""

    def __init__(self, base_url: str, step: str) -> None:
        super().__init__(base_url, timeout_s=30)
        self.step = step

    def _inject(self, step: str) -> None:
        if step == self.step:
            raise ServerError(500, f"/{step}", "injected failure")

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        self._inject("pause")
        super().pause(mode, clear_cache, timeout_s)

    def start_weight_update(self) -> None:
        self._inject("start_weight_update")
        super().start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        if self.step == "update_weights":  # a real server-side failure: the file is not there
            update_info = {"path": "/nonexistent/weights.safetensors"}
        super().update_weights(update_info)

    def finish_weight_update(self, version: str | None = None) -> None:
        self._inject("finish_weight_update")
        super().finish_weight_update(version)

    def resume(self) -> None:
        self._inject("resume")
        super().resume()


class FailingStage(FileTransport):
    def stage(self, model: torch.nn.Module) -> None:
        raise OSError("disk full")


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_each_step_is_an_error_and_the_server_is_resumed(step, server, model, tmp_path):
    control = FailingControl(server.base_url, step)
    transport = FailingStage(tmp_path) if step == "stage" else FileTransport(tmp_path)
    sync = WeightSync(control, transport)
    sync.init(model)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"weight sync failed at {step}"):
        sync.push(model, 7)
        sync.settle()  # the resume is answered after the round returns: its failure comes from here
    assert time.monotonic() - started < 20
    sync.close()
    with ControlClient(server.base_url, timeout_s=30) as plain:
        if step == "resume":
            assert plain.is_paused()  # the one step that cannot resume the server itself
            plain.resume()
        assert not plain.is_paused()
        again = WeightSync(plain, FileTransport(tmp_path))
        again.push(model, 8)  # no half-open update is left behind
        again.close()
        assert plain.weight_version() == "8"


class GatedControl(ControlClient):
    """The built-in server's control calls, held by the test: the pause is answered only once the round has staged,
    the resume only once the test releases it; ``calls`` records each call and each resume's answer in order."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url, timeout_s=30)
        self.staged, self.release = threading.Event(), threading.Event()
        self.calls: list[str] = []

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        self.calls.append("pause")
        super().pause(mode, clear_cache, timeout_s)
        assert self.staged.wait(10), "the round waited for the pause's answer before staging"

    def resume(self) -> None:
        self.calls.append("resume")
        assert self.release.wait(10), "the test never released the resume"
        super().resume()
        self.calls.append("resumed")


class SignallingStage(FileTransport):
    def __init__(self, directory: Path, staged: threading.Event) -> None:
        super().__init__(directory)
        self.staged = staged

    def stage(self, model: torch.nn.Module) -> None:
        super().stage(model)
        self.staged.set()


def test_the_trainer_waits_for_the_pause_while_staging_and_not_for_the_resume(server, model, tmp_path):
    """The pause is answered while the round stages and the resume after the round returns; the next round
    waits for that resume, so its pause cannot overtake it."""
    control = GatedControl(server.base_url)
    sync = WeightSync(control, SignallingStage(tmp_path, control.staged))
    sync.init(model)
    sync.push(model, 1)
    assert control.is_paused() and control.calls == ["pause", "resume"]  # returned with the resume unanswered
    control.release.set()
    metrics = sync.push(model, 2)
    assert control.calls[:4] == ["pause", "resume", "resumed", "pause"] and metrics["perf/generation_paused_s"] > 0
    sync.close()  # collects round 2's resume
    assert control.calls[-1] == "resumed" and not control.is_paused()


class InterruptedSend(FileTransport):
    def send(self, control: ControlClient) -> float:
        raise KeyboardInterrupt


def test_an_interrupted_round_resumes_the_server_before_it_ends(server, model, tmp_path):
    with ControlClient(server.base_url, timeout_s=30) as control:
        sync = WeightSync(control, InterruptedSend(tmp_path))
        sync.init(model)
        with pytest.raises(KeyboardInterrupt):
            sync.push(model, 9)
        assert not control.is_paused()
        sync.close()


@pytest.fixture
def own_server(random_tiny_model_dir: Path, weights_root: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of the test's own, which it hangs or kills."""
    yield from serve_session(random_tiny_model_dir, weights_root, tmp_path / "own-server")


def watched_sync(server: ServerProcess, weights_dir: Path) -> tuple[WeightSync, ControlGroup]:
    """A round as the trainer makes it: its control group checks the server (dead? silent on /health for 1 s, the
    health timeout here?) while each call waits, under a server.timeout far longer than the test may take."""
    watch = ServerWatch(ServerGroup([server]), health_timeout_s=1.0)
    control = ControlGroup.connect(
        [server.base_url], timeout_s=3600, watch=partial(watch.check, "during a weight sync")
    )
    return WeightSync(control, FileTransport(weights_dir)), control


def test_a_server_that_hangs_in_a_round_ends_it_after_the_health_timeout_naming_it(own_server, model, tmp_path):
    """SIGSTOP: the pause is never answered; the round ends on the health watchdog, not on server.timeout."""
    sync, control = watched_sync(own_server, tmp_path)
    sync.init(model)
    assert own_server.proc is not None
    os.kill(own_server.proc.pid, signal.SIGSTOP)
    with pytest.raises(ServerStartError) as raised:
        sync.push(model, 1)
    assert str(raised.value) == (
        f"the generation server at {own_server.base_url} (pid {own_server.proc.pid}) stopped answering /health for 1 s "
        "(server.health_timeout) during a weight sync: it hangs; raise server.health_timeout if it is only slow"
    )
    sync.close()  # makes no call to the hung server
    control.close()


def test_a_server_killed_before_a_round_ends_it_at_once_saying_how_it_died(own_server, model, tmp_path):
    sync, control = watched_sync(own_server, tmp_path)
    sync.init(model)
    assert own_server.proc is not None
    os.kill(own_server.proc.pid, signal.SIGKILL)
    own_server.proc.wait(timeout=30)
    with pytest.raises(ServerStartError) as raised:
        sync.push(model, 1)
    assert re.fullmatch(
        rf"the generation server at {re.escape(own_server.base_url)} \(pid {own_server.proc.pid}\) was killed by "
        rf"SIGKILL; its log's last line: .+ \(log: {re.escape(str(own_server.log_path))}\)",
        str(raised.value),
    ), raised.value
    sync.close()
    control.close()


def test_build_weight_sync_checks_the_server_and_picks_the_file_transport(server, random_tiny_model_dir, tmp_path):
    config = to_config(compose(["server.launch=false", f"server.base_url={server.base_url}",
                                f"model.name_or_path={random_tiny_model_dir}"]))  # fmt: skip
    with ControlClient(server.base_url, timeout_s=30) as control:
        sync = build_weight_sync(build_plan(config), control, tmp_path)
        assert isinstance(sync.transport, FileTransport) and sync.facts.backend == "builtin"
        sync.close()
    assert WEIGHT_SYNC.names() == ["builtin", "ipc", "nccl"]


# ---- the vLLM transports' parts that run without a GPU ------------------------------------------------------


def test_auto_lora_against_the_vllm_asyncrl_launches_merges_and_says_why(caplog):
    """The plan decides merged syncs for a launched vLLM (it has no LoRA); no server is asked, which for a group
    of none would answer adapters."""
    plan = plan_run(compose(["lora=default", "lora.sync=auto", "server=vllm", "server.max_model_len=512"]))
    config, flow = plan.config, plan.flow
    with caplog.at_level(logging.INFO, logger="asyncrl.trainer.weight_sync"):
        assert syncs_adapters(config, ControlGroup([]), "vllm", flow, decided=False) is False
        assert syncs_adapters(config, ControlGroup([]), "vllm", flow, decided=None) is True
    assert caplog.messages == [f"lora.sync=auto chose merged sync: {LAUNCHED_VLLM_MERGES}"]


def test_the_watchdog_turns_a_hang_into_an_error():
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not finish within 0 s"):
        run_watched("NCCL broadcast", lambda: time.sleep(30), timeout_s=0.3)
    peer = Background("POST /update_weights", lambda: (_ for _ in ()).throw(ServerError(400, "/update_weights", "no")))
    with pytest.raises(ServerError, match="no"):
        run_watched("NCCL broadcast", lambda: time.sleep(30), timeout_s=30, peer=peer)
    assert time.monotonic() - started < 5
    assert run_watched("quick", lambda: 42, timeout_s=5) == 42
    with pytest.raises(WeightSyncError, match="no answer within"):
        Background("POST /init_weight_transfer_engine", time.sleep, 30).result(0.1)


@pytest.mark.parametrize(("installed", "ipc", "nccl"), [
    ("0.26.0", "StaticIpcTransport", "StaticNcclTransport"),
    ("0.27.1", "StaticIpcTransport", "StaticNcclTransport"),
    ("0.28.0", "FactoryTransport", "FactoryTransport"),
])  # fmt: skip
def test_the_trainer_api_follows_the_installed_vllm(installed, ipc, nccl, monkeypatch, tmp_path):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: installed)
    config = to_config(compose(["server.dtype=bfloat16"]))
    assert type(ipc_transport(config=config, run_dir=tmp_path, dtype=BF16)).__name__ == ipc
    transport = nccl_transport(config=config, run_dir=tmp_path, dtype=BF16)
    assert type(transport).__name__ == nccl and transport.dtype == torch.bfloat16


def test_without_vllm_the_vllm_transports_say_so(monkeypatch, tmp_path):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: None)
    with pytest.raises(WeightSyncError, match="needs vllm on the trainer side"):
        ipc_transport(config=to_config(compose([])), run_dir=tmp_path, dtype=BF16)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer(self, info: Any) -> None:
        self.calls.append(("init", info))

    def update_weights(self, info: Any) -> None:
        self.calls.append(("update", info))


def test_round_client_pickles_ipc_handles_and_leaves_start_and_finish_to_the_round():
    recorder = Recorder()
    client = RoundClient(recorder)  # type: ignore[arg-type]
    client.init_weight_transfer_engine({"packed": False})
    client.start_weight_update()
    handles = [{"GPU-1": ("args", 1, (2, 3))}]
    client.update_weights({"names": ["w"], "ipc_handles": handles, "tensor_sizes": None})
    client.update_weights([{"names": ["w"], "ipc_handles": handles}, {"names": ["v"]}])
    client.finish_weight_update("3")
    assert [call for call, _ in recorder.calls] == ["init", "update", "update"]
    single = recorder.calls[1][1]
    assert set(single) == {"names", "ipc_handles_pickled"}
    assert pickle.loads(base64.b64decode(single["ipc_handles_pickled"])) == handles
    assert recorder.calls[2][1][1] == {"names": ["v"]} and ipc_json({"names": []}) == {"names": []}


def test_the_packed_ipc_buffer_holds_one_sync_up_to_its_limit(model):
    payload = serving_bytes(model, torch.bfloat16)
    assert payload == sum(2 * tensor.numel() for _, tensor in serving_parameters(model, torch.bfloat16))
    assert serving_bytes(model, None) == 2 * payload  # float32 as trained
    assert payload <= ipc_buffer_bytes(payload) < payload + (1 << 20)
    assert ipc_buffer_bytes(1) == 1 << 20 and ipc_buffer_bytes(10 * IPC_BUFFER_LIMIT) == IPC_BUFFER_LIMIT


class PackedEngine:
    """vLLM >= 0.28's trainer engine as send() sees it: the buffer size it packs into, read when sending."""

    packed_buffer_size_bytes = 1 << 30

    def send_weights(self) -> None:
        self.sent_with = self.packed_buffer_size_bytes


def test_the_factory_ipc_engine_packs_into_a_buffer_sized_for_the_model(model):
    transport = FactoryTransport("ipc", torch.bfloat16, timeout_s=5)
    transport.engine = engine = PackedEngine()
    transport.stage(model)
    transport.send(None)  # type: ignore[arg-type] - the engine's client makes the HTTP calls
    assert engine.sent_with == ipc_buffer_bytes(serving_bytes(model, torch.bfloat16)) == 7 << 20  # 6.4 MB, in MiB


@dataclass(frozen=True)
class FakeParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class SourceV028(ABC):
    @abstractmethod
    def metadata(self) -> list[Any]: ...

    @abstractmethod
    def __iter__(self) -> Any: ...


class SourceV033(ABC):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        assert isinstance(cls.__dict__.get("metadata"), cached_property), "metadata must be a cached_property"

    @property
    @abstractmethod
    def metadata(self) -> list[Any]: ...

    def iter_full(self) -> Any:
        raise NotImplementedError


@pytest.mark.parametrize("base", [SourceV028, SourceV033])
def test_the_weight_source_fits_either_vllm_interface(base, monkeypatch, model):
    module = types.ModuleType("vllm.distributed.weight_transfer")
    module.ParamMeta, module.WeightSource = FakeParamMeta, base  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer", module)
    transport = FactoryTransport("ipc", torch.bfloat16, timeout_s=5)
    source = serving_source(transport, torch.bfloat16, model)
    meta = source.metadata() if base is SourceV028 else source.metadata  # 0.33's trainer_init reads it unstaged
    transport.stage(model)
    pairs = list(source) if base is SourceV028 else list(source.iter_full())
    names = [name for name, _ in model.named_parameters()]
    assert [m.name for m in meta] == [name for name, _ in pairs] == names  # tied lm_head travels once
    assert all(m.dtype == torch.bfloat16 == t.dtype for m, (_, t) in zip(meta, pairs, strict=True))
    assert "lm_head.weight" not in names and model.config.tie_word_embeddings


# ---- in-place ipc sync: the trainer's transport against asyncrl's vLLM worker extension, on a CPU buffer -----


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


def test_a_vision_language_model_sends_its_text_model_and_the_server_keeps_its_tower(random_tiny_vlm_dir, tmp_path):
    """Every transport's payload (vLLM nccl/ipc: serving_parameters + parameter_metadata; the built-in server's
    file) is the text model under the checkpoint's names, which vLLM's Qwen3.5 loader maps."""
    model = load_model(to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}"])), str(random_tiny_vlm_dir))
    perturb(model, seed=1)  # the tower too: were it sent, the server's would change
    stored = load_file(random_tiny_vlm_dir / "model.safetensors")
    text = {name for name in stored if not name.startswith("model.visual.")} - {"lm_head.weight"}  # tied
    streamed = [name for name, _ in serving_parameters(model, None)]
    assert set(streamed) == text and [name for name, _, _ in parameter_metadata(model, None)] == streamed
    sharded = GatheredModel(model, None, None)  # type: ignore[arg-type]  # several ranks' view; metadata needs no gather
    assert [name for name, _, _ in parameter_metadata(sharded, None)] == streamed
    file = FileTransport(tmp_path)
    file.stage(model)
    assert set(load_file(str(file.path))) == text
    file.close(None)  # type: ignore[arg-type]
    served = AutoModelForImageTextToText.from_pretrained(random_tiny_vlm_dir, dtype=torch.float32)
    transport = CpuDirectTransport(None, IPC_BUFFER_LIMIT)
    WeightSync(ExtensionServer(Worker(served), transport), transport).push(model, 1)  # type: ignore[arg-type]
    for (name, trained), (_, loaded) in zip(model.named_parameters(), served.named_parameters(), strict=True):
        assert torch.equal(loaded, stored[name] if name.startswith("model.visual.") else trained), name


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


@pytest.mark.parametrize(("facts", "direct_load", "expected", "why"), [
    ({}, "true", "DirectIpcTransport", None),
    ({"worker_extension": ""}, "true", "StaticIpcTransport", "--worker-extension-cls"),
    ({}, "false", "StaticIpcTransport", None),
    ({"quantization": "fp8"}, "true", "StaticIpcTransport", r"quantizes its weights \(fp8\).*re-quantizes"),
    ({"quantization": "fp8", "worker_extension": ""}, "true", "StaticIpcTransport", r"quantizes its weights"),
    ({"gpus": 2}, "true", "StaticIpcTransport", "spans 2 GPUs"),
])  # fmt: skip
def test_ipc_loads_in_place_where_the_extension_can(facts, direct_load, expected, why, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.26.0")
    config = to_config(compose([f"server.ipc_direct_load={direct_load}"]))
    server = ServerFacts("vllm", "0.26.0", 4096, "ipc", False, **{"worker_extension": WORKER_EXTENSION, **facts})
    with caplog.at_level(logging.INFO, logger="asyncrl.weights.vllm_transports"):
        assert type(ipc_transport(config=config, run_dir=tmp_path, dtype=BF16, facts=server)).__name__ == expected
    if why is not None:
        assert re.search(f"ipc sync through vLLM's engine.*{why}", caplog.text)


def test_a_quantized_server_over_nccl_says_its_session_requantizes(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.33.0")
    config = to_config(compose([]))
    plain = ServerFacts("vllm", "0.33.0", 4096, "nccl", False)
    with caplog.at_level(logging.INFO, logger="asyncrl.weights.vllm_transports"):
        nccl_transport(config=config, run_dir=tmp_path, dtype=BF16, facts=plain)
        assert not caplog.text
        nccl_transport(config=config, run_dir=tmp_path, dtype=BF16, facts=replace(plain, quantization="fp8"))
    assert re.search(r"nccl sync through vLLM's engine: the server quantizes its weights \(fp8\)", caplog.text)
