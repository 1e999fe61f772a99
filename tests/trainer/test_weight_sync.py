"""Weight sync rounds against the built-in server: weights arrive (a vision-language model's tower only when it
trains), and a failure at any step is an error (no hang) that leaves the server resumed and ready for the next
round; a server that hangs or dies mid-round ends it naming the server; a launched vLLM gets merged syncs. The
transports' own tests are in tests/weights/."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from asyncrl.client import Completion, ControlClient, GenerationClient, ServerError
from asyncrl.config.compose import compose, to_config
from asyncrl.control_group import ControlGroup
from asyncrl.plan.assemble import build_plan, plan_run
from asyncrl.rollout.images import data_url, image_processing
from asyncrl.rollout.types import PromptImages
from asyncrl.sampling import SamplingParams
from asyncrl.serving.command import LAUNCHED_VLLM_MERGES, served_name
from asyncrl.serving.group import ServerGroup
from asyncrl.serving.process import ServerProcess, ServerStartError
from asyncrl.serving.watchdog import ServerWatch
from asyncrl.trainer.model import load_model
from asyncrl.trainer.weight_sync import (
    WEIGHT_SYNC,
    WeightSync,
    WeightSyncError,
    build_weight_sync,
    syncs_adapters,
)
from asyncrl.weights.file_transport import FileTransport
from tests.conftest import perturb, serve_session, served_vs_local

STEPS = ("stage", "pause", "start_weight_update", "update_weights", "finish_weight_update", "resume")


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


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


def test_auto_lora_against_the_vllm_asyncrl_launches_merges_and_says_why(caplog):
    """The plan decides merged syncs for a launched vLLM (it has no LoRA); no server is asked, which for a group
    of none would answer adapters."""
    plan = plan_run(compose(["lora=default", "lora.sync=auto", "server=vllm", "server.max_model_len=512"]))
    config, flow = plan.config, plan.flow
    with caplog.at_level(logging.INFO, logger="asyncrl.trainer.weight_sync"):
        assert syncs_adapters(config, ControlGroup([]), "vllm", flow, decided=False) is False
        assert syncs_adapters(config, ControlGroup([]), "vllm", flow, decided=None) is True
    assert caplog.messages == [f"lora.sync=auto chose merged sync: {LAUNCHED_VLLM_MERGES}"]


def metric(text: str, name: str) -> float:
    """A counter or gauge of the server's /metrics (the built-in server's, in vLLM's names)."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def round_with_requests_in_flight(server, model, tmp_path, name: str, in_flight: bool) -> tuple[float, list[int]]:
    """(requests the server preempted, tokens each long request got) across a round that lands while 4 requests
    of 240 tokens are being decoded."""
    outputs: list[int] = []

    async def generate() -> None:
        async with GenerationClient(server.base_url, name, timeout_s=120) as client:
            params = SamplingParams(max_tokens=240, ignore_eos=True, seed=1)
            done = await asyncio.gather(*(client.complete([4, 30, 31, 32, 5], params) for _ in range(4)))
        outputs.extend(len(out.token_ids) for out in done)

    with ControlClient(server.base_url, timeout_s=60) as control:
        sync = WeightSync(control, FileTransport(tmp_path), in_flight=in_flight)
        sync.init(model)
        before = metric(control.metrics_text(), "vllm:num_preemptions_total")
        requests = threading.Thread(target=asyncio.run, args=(generate(),))
        requests.start()
        deadline = time.monotonic() + 30
        while metric(control.metrics_text(), "vllm:num_requests_running") < 4:
            assert time.monotonic() < deadline, "the requests never ran"
        sync.push(model, 1)
        sync.settle()
        requests.join(120)
        preempted = metric(control.metrics_text(), "vllm:num_preemptions_total") - before
        sync.close()
    return preempted, outputs


def test_in_flight_weight_updates_keep_the_requests_decoding_across_a_round(fresh_server, model, random_tiny_model_dir,
                                                                           tmp_path):  # fmt: skip
    """staleness.in_flight_weight_updates: the round's pause keeps the cache (clear_cache=false), so the requests
    in flight go on where they stopped; by default they are preempted and prefilled again under the new weights."""
    name = served_name(str(random_tiny_model_dir))
    perturb(model, seed=2)
    kept, outputs = round_with_requests_in_flight(fresh_server(), model, tmp_path, name, in_flight=True)
    assert kept == 0 and outputs == [240] * 4
    preempted, outputs = round_with_requests_in_flight(fresh_server(), model, tmp_path, name, in_flight=False)
    assert preempted >= 1 and outputs == [240] * 4


def image_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], images: PromptImages) -> torch.Tensor:
    """The completion's log-probabilities under ``model``'s plain forward of the prompt with its image."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw,
                       mm_token_type_ids=(ids == images.token_id).int()).logits[0, len(prompt) - 1 : -1]  # fmt: skip
    return logits.double().log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@pytest.mark.parametrize("freeze", [True, False])
def test_a_trained_vision_tower_reaches_the_built_in_server(fresh_vlm_server, random_tiny_vlm_dir, tmp_path, freeze):
    """A round of a model whose every weight moved: with model.freeze_vision_tower=false the server loads the tower
    too, under its own names, and answers an image prompt as the trained model does; with true it keeps its
    checkpoint's tower (and takes the text model)."""
    server = fresh_vlm_server()
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}", f"model.freeze_vision_tower={freeze}"]))
    model = load_model(config, str(random_tiny_vlm_dir)).eval()
    perturb(model, seed=1)
    base_tower = copy.deepcopy(model)  # the trained text model around the checkpoint's tower
    stored = load_file(random_tiny_vlm_dir / "model.safetensors")
    base_tower.load_state_dict({k: v for k, v in stored.items() if k.startswith("model.visual.")}, strict=False)
    with ControlClient(server.base_url, timeout_s=60) as control:
        sync = WeightSync(control, FileTransport(tmp_path))
        sync.init(model)
        sync.push(model, 1)
        sync.close()
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "1 + 2"}]

    async def chat() -> Completion:
        async with GenerationClient(server.base_url, served_name(str(random_tiny_vlm_dir)), timeout_s=60) as client:
            return await client.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=6, temperature=0.0,
                                                                                          logprobs=0))  # fmt: skip

    served = asyncio.run(chat())
    images = image_processing(config, model.config).patches([image])
    answered = torch.tensor(served.logprobs, dtype=torch.float64)
    expected, other = (base_tower, model) if freeze else (model, base_tower)
    assert torch.allclose(answered, image_logprobs(expected, served.prompt_token_ids, served.token_ids, images),
                          atol=1e-4, rtol=0)  # fmt: skip
    assert not torch.allclose(answered, image_logprobs(other, served.prompt_token_ids, served.token_ids, images),
                              atol=1e-4, rtol=0)  # fmt: skip
