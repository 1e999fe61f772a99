"""Weight sync: push the trainer's weights to the generation server, one round per sync.

Every backend runs vLLM's dev-mode round, and the round's control calls are made here, so the trainer's code
path is the same for every server: stage (outside the pause) -> POST /pause -> /start_weight_update ->
the backend's data plane (its /update_weights calls and the tensors) -> /finish_weight_update -> /resume.
A backend (a ``Transport`` in ``WEIGHT_SYNC``) supplies only the data plane: a safetensors file for the
built-in server (asyncrl/weights/file_transport.py), CUDA IPC handles or an NCCL broadcast for vLLM, through
vLLM's static trainer API on 0.26-0.27 (weights/vllm_static.py) or its trainer engines from 0.28
(weights/vllm_factory.py), chosen by the installed vLLM. On a vLLM running asyncrl's worker extension, ipc loads in
place instead (weights/vllm_direct.py): one /collective_rpc per chunk of a buffer shared once, and no
start/finish session (``Transport.session``), which is where vLLM re-materialises every layer. LoRA runs
whose lora.sync resolves to adapters (weights/adapter_choice.py) use ``AdapterSync`` instead (weights/adapter.py): no
pause, only the adapter is sent.

With several servers (server.replicas, server.base_urls) the control client is a ``ControlGroup``
(asyncrl/control_group.py): each call of the round reaches every server concurrently, so one round is pause all
-> start all -> each server's data plane -> finish all -> resume all. The built-in file and the adapter are
written once (the replicas share one weights directory) and every server loads them; NCCL spans all servers in
one group; ipc reaches one co-located server only (serving/checks.py::check_servers refuses more).

The pause is ``mode=keep``: it freezes in-flight requests instead of aborting them, so no generated token is
thrown away. By default with ``clear_cache=true``, which then preempts them and drops the prefix cache: after
resume every request re-prefills under the new weights, so no token is ever computed on a KV cache the old
weights produced and no new prompt reuses old-weight prefix blocks. staleness.in_flight_weight_updates sends
``clear_cache=false`` (PipelineRL's in-flight updates): no re-prefill, the new weights run on the old cache, and
each token's sampler log-probability, which the importance correction reads, is still the one it was drawn with.
Each HTTP call is checked and timed out (server.timeout); the transfer runs on a
watchdog; a failed round closes the half-finished update (best effort), resumes the server and raises
``WeightSyncError`` naming the step. The trainer's control group also watches its servers while a call waits
(asyncrl/control_group.py): a server that dies or hangs mid-round raises ServerStartError at once, or after
server.health_timeout, and the round's cleanup makes no call to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.client import Control, ControlClient
from asyncrl.config.schema import Config, LoraSync
from asyncrl.control_group import ControlGroup
from asyncrl.flow import FlowControl
from asyncrl.registry import Registry
from asyncrl.serving.checks import ServerFacts, check_servers
from asyncrl.serving.command import LAUNCHED_VLLM_MERGES
from asyncrl.weights.adapter import AdapterSync
from asyncrl.weights.adapter_choice import use_adapter_sync
from asyncrl.weights.file_transport import FileTransport
from asyncrl.weights.tensors import serving_bytes
from asyncrl.weights.transport import Background, Transport, WeightSyncError, run_step
from asyncrl.weights.vllm_transports import ipc_transport, nccl_transport

if TYPE_CHECKING:
    from asyncrl.run_plan import RunPlan

log = logging.getLogger(__name__)

PAUSE_MODE = "keep"
CLEANUP_TIMEOUT_S = 30.0
__all__ = ["WEIGHT_SYNC", "AdapterSync", "Transport", "WeightSync", "WeightSyncError", "build_weight_sync"]


WEIGHT_SYNC: Registry[Callable[..., Transport]] = Registry("weight sync backend")


class WeightSync:
    """One backend's rounds: ``init()`` once, ``push(model, version)`` per sync, ``close()`` at the end.

    The trainer waits for the round's critical path only: /pause is sent as the round starts and answered while
    the transport stages (the engine finishes its step in flight meanwhile), and /resume is sent at the end but
    answered while the trainer goes on. ``settle`` collects it: at the next round, before the trainer evaluates and
    at ``close``; ``check`` raises its failure from the trainer's wait for rollouts, so a failed resume ends the run
    instead of starving it. A round never starts before the last resume was answered, so no pause is overtaken by
    the resume before it."""

    adapter_prefix: str | None = None  # the policy is served under the base model's name (AdapterSync's differs)
    adapter_only = False  # it sends every weight (merged under LoRA); AdapterSync reads only the trained ones

    def __init__(self, control: Control, transport: Transport, facts: ServerFacts | None = None, *,
                 in_flight: bool = False) -> None:  # fmt: skip
        self.control, self.transport, self.facts = control, transport, facts
        self.clear_cache = not in_flight
        """False: staleness.in_flight_weight_updates (the module docstring says what each keeps)."""
        self._resuming: Background[float] | None = None
        self._paused_at = 0.0
        self._unreported: dict[str, float] = {}

    def init(self, model: torch.nn.Module) -> None:
        """Set the backend up once; ``model`` is what ``push`` will be given (vLLM >= 0.33's engines declare its
        names and shapes at init)."""
        run_step("init_weight_transfer_engine", self.transport.init, self.control, model)

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """One round; returns perf/weight_sync_s (what the trainer waited) split into _stage_s, _pause_s (the wait
        for the pause's answer after staging), _barrier_s and _transfer_s; the bytes of the parameters sent
        (perf/weight_sync_bytes); and how long the previous round kept generation paused, from /pause sent to
        /resume answered (perf/generation_paused_s)."""
        self.settle()
        metrics, self._unreported = self._unreported, {}
        failure: WeightSyncError | None = None
        stage_s = pause_s = barrier_s = 0.0
        self._paused_at = started = time.perf_counter()
        pausing = Background("POST /pause", self.control.pause, PAUSE_MODE, self.clear_cache)
        try:
            try:
                run_step("stage", self.transport.stage, model)
            finally:
                stage_s = time.perf_counter() - started
                run_step("pause", pausing.result, self.control.timeout_s)  # joined first: no resume overtakes it
            pause_s = time.perf_counter() - started - stage_s
            barrier_s = self._update(version)
        except WeightSyncError as error:
            failure = error
        except BaseException:  # Ctrl-C, SystemExit or a dead or hung server mid-round: no server may stay paused
            self._resume_after_failure(pausing)
            raise
        finally:
            self.transport.discard()
        if failure is not None:
            self._resume_after_failure(pausing)
            raise failure
        self._resuming = Background("POST /resume", self._resume)
        total = time.perf_counter() - started
        return metrics | {
            "perf/weight_sync_s": total,
            "perf/weight_sync_bytes": float(serving_bytes(model, getattr(self.transport, "dtype", None))),
            "perf/weight_sync_stage_s": stage_s,
            "perf/weight_sync_pause_s": pause_s,
            "perf/weight_sync_barrier_s": barrier_s,
            "perf/weight_sync_transfer_s": total - stage_s - pause_s - barrier_s,
        }

    def check(self) -> None:
        """Raise now if the last round's resume failed (the server would stay paused and rollouts never come)."""
        if self._resuming is not None and self._resuming.done():
            self.settle()

    def settle(self) -> None:
        """Wait for the last round's resume (raising its failure): afterwards the server generates. How long that
        round kept generation paused goes into the next round's metrics."""
        resuming, self._resuming = self._resuming, None
        if resuming is not None:
            resumed_at = run_step("resume", resuming.result, self.control.timeout_s)
            self._unreported["perf/generation_paused_s"] = resumed_at - self._paused_at

    def _resume(self) -> float:
        """POST /resume; when it was answered (perf_counter)."""
        self.control.resume()
        return time.perf_counter()

    def _update(self, version: int) -> float:
        session = self.transport.session
        if session:
            run_step("start_weight_update", self.control.start_weight_update)
        try:
            barrier_s = run_step("update_weights", self.transport.send, self.control)
            if session:
                run_step("finish_weight_update", self.control.finish_weight_update, str(version))
        except WeightSyncError as error:
            if session:
                self._abandon_update()
            raise WeightSyncError(f"{error} (the server may hold partly updated weights until a full sync)") from error
        return barrier_s

    def _abandon_update(self) -> None:
        """Best effort: close the half-finished update so the server is not left in a session."""
        with self.control.reopened(CLEANUP_TIMEOUT_S) as cleanup:
            try:
                cleanup.finish_weight_update()
            except Exception as error:  # noqa: BLE001 - the server may already have ended the session
                log.info("closing the failed weight update: %s", error)

    def _resume_after_failure(self, pausing: Background[None]) -> None:
        """Resume after a failed round, so generation never stays paused: once the round's pause has finished (a
        resume must not overtake it; its own error is the round's, or moot), with the short cleanup timeout since
        the server may be stuck (a dead transfer peer). The resume's own failure is logged, not raised over the
        round's."""
        try:
            pausing.result(CLEANUP_TIMEOUT_S)
        except BaseException as error:  # noqa: BLE001 - the round already failed; this only orders the calls
            log.info("the failed round's pause: %s", error)
        with self.control.reopened(CLEANUP_TIMEOUT_S) as cleanup:
            try:
                run_step("resume", cleanup.resume)
            except Exception as error:  # noqa: BLE001 - a failed sync or a dead or hung server: the round's error leads
                log.warning("could not resume the server after a failed weight sync: %s", error)

    def close(self) -> None:
        """Collect the last resume and release the transport; best effort, the server may be gone at the end."""
        for step in (self.settle, lambda: self.transport.close(self.control)):
            try:
                step()
            except Exception as error:  # noqa: BLE001 - the end of the run must not fail on cleanup
                log.warning("weight sync close: %s", error)


def build_weight_sync(plan: RunPlan, control: ControlClient | ControlGroup, run_dir: Path) -> WeightSync | AdapterSync:
    """Check the running servers against the plan, then build the sync backend they speak (not yet init'ed),
    reaching every one of them: adapter-only sync when lora.sync resolves to it on each (``use_adapter_sync``),
    else a merged/full weight round, in the plan's serving dtype."""
    config, flow = plan.config, plan.flow
    group = control if isinstance(control, ControlGroup) else ControlGroup([control])
    facts = check_servers(plan, group.controls)
    log.info(
        "server %s %s: max_model_len %d, weight transfer %s, candidate sets %s",
        facts.backend,
        facts.version,
        facts.max_model_len,
        facts.weight_transfer,
        facts.candidate_sets,
    )
    if syncs_adapters(config, group, facts.backend, flow, plan.adapter_sync):
        output_dir = Path(config.server.weights_dir or config.trainer.output_dir or run_dir)
        log.info("LoRA adapter-only sync: versions under %s", output_dir / ".vllm_lora")
        return AdapterSync(group, config, output_dir, facts, flow=flow, dtype=plan.serving_dtype)
    make = WEIGHT_SYNC.get(facts.weight_transfer)
    transport = make(config=config, run_dir=run_dir, dtype=plan.serving_dtype, facts=facts)
    return WeightSync(group, transport, facts, in_flight=config.staleness.in_flight_weight_updates)


def syncs_adapters(config: Config, group: ControlGroup, backend: str, flow: FlowControl, decided: bool | None) -> bool:
    """The plan's answer (RunPlan.adapter_sync) where the config alone decides, else every server's."""
    if decided is False and config.lora.enabled and config.lora.sync == LoraSync.auto:
        log.info("lora.sync=auto chose merged sync: %s", LAUNCHED_VLLM_MERGES)
    if decided is not None:
        return decided
    return all([use_adapter_sync(config, replica, backend, flow) for replica in group.controls])


WEIGHT_SYNC.register("builtin")(FileTransport.from_config)
WEIGHT_SYNC.register("ipc")(ipc_transport)
WEIGHT_SYNC.register("nccl")(nccl_transport)
