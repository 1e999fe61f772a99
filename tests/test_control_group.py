"""The trainer's control of several servers: every call reaches each replica, a failure names its replica, and
NCCL ranks follow the trainer replica after replica. Fakes of our own ControlClient, no server."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest

from asyncrl.client import Control, ControlClient, ServerError
from asyncrl.control_group import DEATH_GRACE_S, ControlGroup, rank_offsets
from asyncrl.serving.process import ServerStartError


class FakeControl:
    """ControlClient's calls that the group makes, recorded; ``fails`` names the call that raises."""

    def __init__(self, base_url: str, world_size: int = 1, max_model_len: int = 256, fails: str = "") -> None:
        self.base_url, self._world, self._len, self.fails = base_url, world_size, max_model_len, fails
        self.calls: list[tuple[str, Any]] = []

    def _call(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if name == self.fails:
            raise ServerError(500, f"/{name}", "engine dead")

    def world_size(self) -> int:
        return self._world

    def max_model_len(self) -> int:
        return self._len

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer", init_info)

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        self._call("pause", mode)

    def resume(self) -> None:
        self._call("resume")

    def load_lora_adapter(self, name: str, path: str) -> None:
        self._call("load_lora_adapter", (name, path))

    def unload_lora_adapter(self, name: str) -> None:
        self._call("unload_lora_adapter", name)

    def reopened(self, timeout_s: float) -> FakeControl:
        return self


def group(*controls: FakeControl) -> ControlGroup:
    return ControlGroup(list(controls))  # type: ignore[arg-type]


def test_rank_offsets_put_each_replicas_workers_after_the_trainer():
    assert rank_offsets(1, [2, 4, 1]) == [1, 3, 7]  # trainer rank 0; a TP=2, a TP=2 x DP=2, a single GPU
    assert rank_offsets(1, [8]) == [1]


def test_one_nccl_group_spans_every_replica():
    a, b = FakeControl("http://a", world_size=2), FakeControl("http://b", world_size=4)
    servers = group(a, b)
    assert servers.world_size() == 6  # the transports add the trainer: world_size 7
    servers.init_weight_transfer({"master_address": "10.0.0.1", "master_port": 5, "rank_offset": 1, "world_size": 7})
    assert [c.calls[0][1]["rank_offset"] for c in (a, b)] == [1, 3]
    assert {c.calls[0][1]["world_size"] for c in (a, b)} == {7}


def test_an_init_without_ranks_goes_to_each_replica_as_it_is():
    a, b = FakeControl("http://a"), FakeControl("http://b")
    group(a, b).init_weight_transfer({"backend": "builtin"})
    assert a.calls == b.calls == [("init_weight_transfer", {"backend": "builtin"})]


def test_every_replica_gets_the_call_and_a_failure_names_its_replica():
    a, b = FakeControl("http://a"), FakeControl("http://b", fails="pause")
    with pytest.raises(ServerError) as raised:
        group(a, b).pause("keep")
    assert str(raised.value) == "/pause: HTTP 500: replica 1 of 2 (http://b): engine dead"
    assert a.calls == b.calls == [("pause", "keep")]


def test_the_servers_context_is_the_shortest():
    assert (
        group(FakeControl("http://a", max_model_len=512), FakeControl("http://b", max_model_len=300)).max_model_len()
        == 300
    )


def test_one_server_is_called_directly_and_its_errors_are_unchanged():
    only = FakeControl("http://a", fails="resume")
    with pytest.raises(ServerError, match=r"^/resume: HTTP 500: engine dead$"):
        group(only).resume()


class HangingControl(FakeControl):
    """A server whose /pause answers only once ``answer`` is set (hung until then)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.answer = threading.Event()

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        self._call("pause", mode)
        self.answer.wait()


class Watch:
    """The trainer's watch, scripted: it raises on its ``raise_at``-th check; ``then`` runs at each check."""

    def __init__(self, raise_at: int | None = None, then: Callable[[int], None] = lambda checks: None) -> None:
        self.checks, self.raise_at, self.then = 0, raise_at, then

    def __call__(self) -> None:
        self.checks += 1
        self.then(self.checks)
        if self.checks == self.raise_at:
            raise ServerStartError("the generation server at http://a stopped answering /health")


def test_a_watch_that_finds_the_server_hung_ends_the_wait_on_its_call():
    hung = HangingControl("http://a")
    watch = Watch(raise_at=3)
    try:
        with pytest.raises(ServerStartError, match="stopped answering /health"):
            ControlGroup([hung], watch).pause("keep")  # type: ignore[list-item]
        assert hung.calls == [("pause", "keep")] and watch.checks == 3  # before the call, then while it waited
    finally:
        hung.answer.set()


def test_a_slow_call_is_waited_for_while_the_watch_finds_the_server_alive():
    slow = HangingControl("http://a")
    watch = Watch(then=lambda checks: slow.answer.set() if checks == 5 else None)  # answers at the 5th check
    ControlGroup([slow], watch).pause("keep")  # type: ignore[list-item]
    assert slow.calls == [("pause", "keep")] and watch.checks >= 5


def test_a_server_known_dead_or_hung_gets_no_call_not_even_a_cleanups():
    a, b = FakeControl("http://a"), FakeControl("http://b")
    watched = ControlGroup([a, b], Watch(raise_at=1))  # type: ignore[list-item]
    with pytest.raises(ServerStartError):
        watched.resume()
    assert a.calls == b.calls == []
    assert watched.reopened(30).watch is watched.watch


class DroppedControl(FakeControl):
    """A server killed mid-call: the connection drops without an answer (ControlClient's ServerError, status None)."""

    def pause(self, mode: str, clear_cache: bool = True, timeout_s: float | None = None) -> None:
        self.calls.append(("pause", mode))
        raise ServerError(None, "/pause", "RemoteProtocolError: Server disconnected without sending a response.")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_dropped_connection_leaves_the_watch_time_to_name_the_dead_server():
    """The process of a server killed mid-sync is reaped a moment after its connections drop: the death leads."""
    clock = FakeClock()
    watch = Watch(raise_at=4)  # before the call, once at the drop, then after two waits: reaped by then
    with pytest.raises(ServerStartError, match="stopped answering") as raised:
        ControlGroup([DroppedControl("http://a")], watch, clock, clock.sleep).pause("keep")  # type: ignore[list-item]
    assert isinstance(raised.value.__context__, ServerError) and clock.now == pytest.approx(0.4)


def test_a_dropped_connection_of_a_live_server_is_the_calls_error_after_the_grace():
    clock = FakeClock()
    watch = Watch()
    with pytest.raises(ServerError, match="Server disconnected"):
        ControlGroup([DroppedControl("http://a")], watch, clock, clock.sleep).pause("keep")  # type: ignore[list-item]
    assert DEATH_GRACE_S <= clock.now <= DEATH_GRACE_S + 0.5 and watch.checks >= 1 + DEATH_GRACE_S / 0.2


def test_an_answered_error_is_the_calls_at_once():
    """An HTTP error is an answer: the server lives, no grace."""
    clock = FakeClock()
    with pytest.raises(ServerError, match="engine dead"):
        ControlGroup([FakeControl("http://a", fails="pause")], Watch(), clock, clock.sleep).pause("keep")  # type: ignore[list-item]
    assert clock.now == 0.0


def test_adapter_sync_writes_each_version_once_and_loads_it_on_every_replica(random_tiny_model_dir, tmp_path):
    from asyncrl.config.compose import compose
    from asyncrl.plan.assemble import plan_run
    from asyncrl.trainer.model import load_model
    from asyncrl.weights.adapter import AdapterSync

    plan = plan_run(compose([f"model.name_or_path={random_tiny_model_dir}", "lora=default", "lora.r=8",
                             "staleness.max_staleness=0", "lora.sync=adapter"]))  # fmt: skip
    config = plan.config
    a, b = FakeControl("http://a"), FakeControl("http://b")
    sync = AdapterSync(group(a, b), config, tmp_path, flow=plan.flow, dtype=plan.serving_dtype)  # type: ignore[arg-type]
    model = load_model(config, str(random_tiny_model_dir))
    sync.init(model)
    for version in (1, 2):
        sync.push(model, version)
    loads = [("load_lora_adapter", (sync.name(v), str(sync.path(v)))) for v in (1, 2)]
    expected = [*loads, ("unload_lora_adapter", sync.name(1))]
    assert a.calls == b.calls == expected  # every live version on every replica
    assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == [sync.name(1), sync.name(2)]


def test_one_client_and_a_group_speak_the_control_protocol_the_weight_sync_types():
    """Every member of ``Control`` exists on both with its signature; a call the round makes on one and not the
    other would fail only with several servers (or only with one)."""
    members = {name for name in vars(Control) if not name.startswith("_") or name in ("__enter__", "__exit__")}
    members |= set(Control.__annotations__)
    for cls in (ControlClient, ControlGroup):
        for name in sorted(members):
            if name in Control.__annotations__:  # attributes: set in __init__ or a property
                assert name in inspect.getsource(cls), f"{cls.__name__} has no {name}"
                continue
            wanted, found = inspect.signature(getattr(Control, name)), inspect.signature(getattr(cls, name))
            assert list(found.parameters) == list(wanted.parameters), f"{cls.__name__}.{name}{found} != {wanted}"
