"""The trainer's control client for every generation server of the run at once.

``ControlGroup`` speaks ``ControlClient``'s interface, so the weight-sync round (trainer/weight_sync.py), its
transports and adapter sync run unchanged over one server or several: each state-changing call (pause, the
weight-update session, /update_weights, adapter loads, resume) goes to every replica concurrently and returns
once all have answered, so a round is pause all -> start all -> each server's data plane -> finish all -> resume
all. A failure names the replica; the others' calls still finish first, so no call is left in flight. With a
``watch`` (the trainer's: is any server dead, or silent on /health for server.health_timeout?), each call is made
on a daemon thread and the caller checks ``watch()`` between short waits for the answers: a server that dies or
hangs mid-sync ends the wait at once, or within server.health_timeout, instead of after server.timeout, while a
slow call whose server answers /health is waited for. The calls the watch gave up on are left on their threads
(they end when the run stops the server; being daemons, they never hold the process at exit). A call that got no
answer at all (the connection dropped) gives the watch ``DEATH_GRACE_S`` to see its server's end first: a killed
server's connections close a moment before its process can be reaped, and "server disconnected" would hide what
died (on the H200, a vLLM killed mid-sync restarted the run as a WeightSyncError at /pause).

NCCL weight transfer spans every server in one group: the trainer is rank 0 and each replica's workers follow,
replica after replica (``rank_offsets``); the group's ``world_size()`` is their sum, which the transports already
add the trainer to. Unverified on GPUs here (no multi-GPU machine was lent): the arithmetic is unit-tested.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from asyncrl.client import ControlClient, ServerError
from asyncrl.weights.transport import Background

R = TypeVar("R")
WATCH_INTERVAL_S = 0.2
"""Seconds between two ``watch()`` checks while calls wait (the trainer checks as often while it waits for rollouts)."""
DEATH_GRACE_S = 2.0
"""Seconds a call that got no answer leaves the watch to find its server dead before the call's own error leads."""


def rank_offsets(first: int, world_sizes: Sequence[int]) -> list[int]:
    """The NCCL rank of each replica's first worker: after ``first`` (the trainer's ranks), replica after replica.
    vLLM numbers a replica's workers ``rank_offset + data_parallel_index * (TP x PP) + rank``."""
    offsets, next_rank = [], first
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets


class ControlGroup:
    """``ControlClient``'s calls over ``controls`` (replica 0 first), each wait checked by ``watch`` if given."""

    def __init__(
        self,
        controls: list[ControlClient],
        watch: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.controls, self.watch, self.clock, self.sleep = controls, watch, clock, sleep

    @classmethod
    def connect(
        cls, base_urls: Sequence[str], timeout_s: float, watch: Callable[[], None] | None = None
    ) -> ControlGroup:
        return cls([ControlClient(url, timeout_s=timeout_s) for url in base_urls], watch)

    @property
    def base_url(self) -> str:
        """Replica 0's address (the NCCL rendezvous address is the route towards it)."""
        return self.controls[0].base_url

    @property
    def timeout_s(self) -> float:
        """The longest a call may take: each replica's client times its own calls out."""
        return max(control.timeout_s for control in self.controls)

    @property
    def base_urls(self) -> list[str]:
        return [control.base_url for control in self.controls]

    def each(self, call: Callable[[ControlClient], R]) -> list[R]:
        """``call`` on every replica, concurrently, ``watch()`` between short waits (once first: a server known
        dead or hung gets no call); once all have returned, the first failure, naming its replica."""
        if self.watch is None and len(self.controls) == 1:
            return [call(self.controls[0])]
        if self.watch is not None:
            self.watch()
        calls = [Background(f"a call to {control.base_url}", call, control) for control in self.controls]
        for pending in calls:
            while not pending.wait(WATCH_INTERVAL_S):
                if self.watch is not None:
                    self.watch()
        results = []
        for index, done in enumerate(calls):
            try:
                results.append(done.result(0))
            except ServerError as error:
                if error.status is None:
                    self._blame_a_dead_server()
                if len(self.controls) == 1:
                    raise
                where = f"replica {index} of {len(self.controls)} ({self.controls[index].base_url})"
                raise ServerError(error.status, error.path, f"{where}: {error.message}") from error
        return results

    def _blame_a_dead_server(self) -> None:
        """After a call got no answer: ``watch()`` for DEATH_GRACE_S, so that a server that died raises its own end
        (how it ended, its log) rather than the dropped connection."""
        if self.watch is None:
            return
        deadline = self.clock() + DEATH_GRACE_S
        while True:
            self.watch()
            if self.clock() >= deadline:
                return
            self.sleep(WATCH_INTERVAL_S)

    # ---- queries: what every replica together offers ---------------------------------------------------------

    def max_model_len(self) -> int:
        """The shortest context of any replica: every request must fit whichever serves it."""
        return min(self.each(lambda control: control.max_model_len()))

    def world_size(self) -> int:
        """Server ranks a weight transfer reaches, over every replica."""
        return sum(self.each(lambda control: control.world_size()))

    # ---- the weight-sync round, on every replica -------------------------------------------------------------

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """With an NCCL ``rank_offset``, each replica's workers get their own ranks in the one group."""
        if "rank_offset" not in init_info or len(self.controls) == 1:
            self.each(lambda control: control.init_weight_transfer(init_info))
            return
        sizes = self.each(lambda control: control.world_size())
        offsets = rank_offsets(int(init_info["rank_offset"]), sizes)
        ranked = {id(c): {**init_info, "rank_offset": offset} for c, offset in zip(self.controls, offsets, strict=True)}
        self.each(lambda control: control.init_weight_transfer(ranked[id(control)]))

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        self.each(lambda control: control.pause(mode, clear_cache, timeout_s))

    def resume(self) -> None:
        self.each(lambda control: control.resume())

    def start_weight_update(self) -> None:
        self.each(lambda control: control.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.each(lambda control: control.update_weights(update_info))

    def finish_weight_update(self, version: str | None = None) -> None:
        self.each(lambda control: control.finish_weight_update(version))

    def shutdown_weight_transfer(self) -> None:
        self.each(lambda control: control.shutdown_weight_transfer())

    def collective_rpc(self, method: str, **kwargs: str) -> list[Any]:
        return [result for results in self.each(lambda c: c.collective_rpc(method, **kwargs)) for result in results]

    def load_lora_adapter(self, name: str, path: str) -> None:
        self.each(lambda control: control.load_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        self.each(lambda control: control.unload_lora_adapter(name))

    def reopened(self, timeout_s: float) -> ControlGroup:
        """The same replicas with a fresh client each under ``timeout_s`` (cleanup after a failed round), watched
        alike: no cleanup waits on a server known dead or hung."""
        controls = [control.reopened(timeout_s) for control in self.controls]
        return ControlGroup(controls, self.watch, self.clock, self.sleep)

    def close(self) -> None:
        for control in self.controls:
            control.close()

    def __enter__(self) -> ControlGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
