"""The vLLM transports' parts that run without a GPU: the transfer watchdog, the trainer API each installed vLLM
gets (static before 0.28, its trainer engines from 0.28), the packed ipc buffer, the weight source either engine
interface reads, and when ipc loads in place through asyncrl's worker extension."""

from __future__ import annotations

import base64
import logging
import pickle
import re
import sys
import time
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import pytest
import torch

from asyncrl.client import ServerError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import ModelDtype
from asyncrl.serving.checks import ServerFacts
from asyncrl.serving.vllm import WORKER_EXTENSION
from asyncrl.weights.tensors import serving_bytes, serving_parameters
from asyncrl.weights.transport import Background, WeightSyncError
from asyncrl.weights.vllm_common import IPC_BUFFER_LIMIT, ipc_buffer_bytes, ipc_json, run_watched
from asyncrl.weights.vllm_factory import FactoryTransport, RoundClient, serving_source
from asyncrl.weights.vllm_transports import ipc_transport, nccl_transport

BF16 = ModelDtype.bfloat16
"""The serving dtype the transport tests send in (a run's plan decides it)."""


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
