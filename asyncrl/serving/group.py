"""Every generation server of a run as one handle: one server, ``server.replicas`` launched ones, or the
``server.base_urls`` a run attaches to.

The launched replicas are all started before any is waited on, so they boot concurrently (and while the trainer
loads its model). The group is alive only while every replica is: a replica that dies stops the run, with its
name and the root cause from its log, rather than the run shrinking to the others. Every weight sync goes to all
replicas in one round; one that died mid-sync would keep the old weights (or half of the new ones) and, left in
the rotation, serve a stale policy whose samples no version number describes. Restarting it would need a sync of
its own before its first request; stopping is the honest answer until that exists.
"""

from __future__ import annotations

from contextlib import ExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

from asyncrl.serving.handle import DeferredServer
from asyncrl.serving.process import ServerStartError

if TYPE_CHECKING:
    from asyncrl.footprint import TrainerMemory


class ServerGroup:
    """``servers``: LaunchedServer or AttachedServer handles (serving/handle.py), replica 0 first. ``wait=False``:
    entering only starts the launched ones, and ``ready()`` waits for them all."""

    def __init__(self, servers: list[Any], wait: bool = True) -> None:
        self.servers = servers
        self.wait = wait
        self._stack = ExitStack()

    @property
    def base_url(self) -> str:
        """Replica 0's address: what a one-server caller (the trainer ranks, the benchmarks) talks to."""
        return str(self.servers[0].base_url)

    @property
    def base_urls(self) -> list[str]:
        return [str(server.base_url) for server in self.servers]

    @property
    def backend(self) -> str:
        return str(self.servers[0].backend)

    def name(self, index: int) -> str:
        """How errors name a replica (their own words give its address): nothing to add when there is one."""
        if len(self.servers) == 1:
            return ""
        return f"replica {index} of {len(self.servers)}: "

    @property
    def waits_for_warm_up(self) -> bool:
        """Whether a replica is a vLLM not yet launched because its share of the GPU is the trainer's warm-up's."""
        return any(isinstance(server, DeferredServer) and not server.launched for server in self.servers)

    @property
    def shares_trainer_gpu(self) -> bool:
        """Whether a replica is a vLLM on the trainer's GPU (launched with the share the warm-up left it)."""
        return any(isinstance(server, DeferredServer) for server in self.servers)

    def start(self, memory: TrainerMemory | None = None) -> None:
        """Launch the replicas that waited for the trainer's warm-up, on the footprint it measured (``memory``),
        without waiting for their health."""
        for server in self.servers:
            if isinstance(server, DeferredServer):
                server.start(memory)

    def ready(self) -> None:
        """Return once every replica answers /health; a failed start raises naming the replica."""
        for index, server in enumerate(self.servers):
            try:
                server.ready()
            except ServerStartError as error:
                raise ServerStartError(f"{self.name(index)}{error}") from error

    def is_alive(self) -> bool:
        return all(server.is_alive() for server in self.servers)

    def describe(self, index: int) -> str:
        """How lines name replica ``index``: the replica, then the server's own words (address, backend, pid)."""
        return f"{self.name(index)}{self.servers[index].describe()}"

    def death_line(self) -> str:
        """The first dead replica, named, with how it ended and its log (call it once ``is_alive()`` is False)."""
        index = next(i for i, server in enumerate(self.servers) if not server.is_alive())
        return f"{self.name(index)}{self.servers[index].death_line()}"

    def __enter__(self) -> ServerGroup:
        with ExitStack() as stack:
            for index, server in enumerate(self.servers):
                try:
                    stack.enter_context(server)
                except ServerStartError as error:
                    raise ServerStartError(f"{self.name(index)}{error}") from error
            if self.wait:
                self.ready()
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.close()
