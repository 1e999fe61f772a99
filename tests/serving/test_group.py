"""ServerGroup over fakes of our own server handles: entered together, ready when all are, and a dead or silent
replica is named by its number, then the server's own words."""

from __future__ import annotations

import pytest

from asyncrl.serving.group import ServerGroup
from asyncrl.serving.process import ServerStartError


class FakeServer:
    """LaunchedServer's interface: ``alive`` and ``fails_ready`` script it; ``events`` records the order."""

    backend = "builtin"

    def __init__(self, base_url: str, events: list[str], alive: bool = True, fails_ready: bool = False) -> None:
        self.base_url, self.events, self.alive, self.fails_ready = base_url, events, alive, fails_ready

    def __enter__(self) -> FakeServer:
        self.events.append(f"start {self.base_url}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.append(f"stop {self.base_url}")

    def ready(self) -> None:
        self.events.append(f"ready {self.base_url}")
        if self.fails_ready:
            raise ServerStartError(f"{self.describe()} exited with code 1 during startup: OSError: no model")

    def is_alive(self) -> bool:
        return self.alive

    def describe(self) -> str:
        return f"the generation server at {self.base_url} (built-in, pid 7)"

    def death_line(self) -> str:
        return f"{self.describe()} was killed by SIGKILL; its log's last line: loaded (log: {self.base_url}.log)"


def test_replicas_start_together_then_wait_and_stop_in_reverse():
    events: list[str] = []
    servers = [FakeServer("http://a", events), FakeServer("http://b", events)]
    with ServerGroup(servers) as group:
        assert group.base_urls == ["http://a", "http://b"] and group.base_url == "http://a"
    assert events == ["start http://a", "start http://b", "ready http://a", "ready http://b", "stop http://b",
                      "stop http://a"]  # fmt: skip


def test_a_replica_that_fails_to_start_is_named_and_every_replica_stops():
    events: list[str] = []
    servers = [FakeServer("http://a", events), FakeServer("http://b", events, fails_ready=True)]
    with pytest.raises(
        ServerStartError, match=r"^replica 1 of 2: the generation server at http://b \(built-in, pid 7\) exited"
    ):
        with ServerGroup(servers):
            pass
    assert events[-2:] == ["stop http://b", "stop http://a"]


def test_a_dead_replica_is_named_with_how_it_ended():
    """What check_alive (serving/handle.py) raises with: the run stops rather than shrink to the live replicas."""
    events: list[str] = []
    group = ServerGroup([FakeServer("http://a", events), FakeServer("http://b", events, alive=False)])
    assert not group.is_alive()
    assert group.death_line() == (
        "replica 1 of 2: the generation server at http://b (built-in, pid 7) was killed by SIGKILL; its log's last "
        "line: loaded (log: http://b.log)"
    )
    assert group.describe(0) == "replica 0 of 2: the generation server at http://a (built-in, pid 7)"  # the watchdog's


def test_one_server_is_not_called_a_replica():
    group = ServerGroup([FakeServer("http://a", [], alive=False)])
    assert group.death_line().startswith("the generation server at http://a (built-in, pid 7) was killed by SIGKILL")
    assert group.describe(0) == "the generation server at http://a (built-in, pid 7)"
