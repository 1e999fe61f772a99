"""What the trainer holds of the server: its URL, whether it is alive, and how to stop it if we own it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from asyncrl.run_plan import ServerCommand
from asyncrl.serving.process import ServerProcess, ServerStartError, wait_for_health
from asyncrl.serving.vllm import memory_refusal_hint

if TYPE_CHECKING:
    from asyncrl.footprint import TrainerMemory

KINDS = {"vllm": "vLLM", "builtin": "built-in"}
"""How lines name each backend (``ServerProcess.kind``)."""


class LaunchedServer(ServerProcess):
    """A server this run started; stopped when the run ends. With ``wait=False`` entering only starts it, so the
    trainer can load its model while the server boots, and ``ready()`` waits for its health before first use."""

    def __init__(
        self, command: ServerCommand, base_url: str, log_path: Path, timeout_s: float, wait: bool = True
    ) -> None:
        super().__init__(
            command.argv, base_url=base_url, log_path=log_path, env=command.env, startup_timeout_s=timeout_s
        )
        self.backend = command.backend
        self.kind = KINDS[command.backend]
        self._wait_on_enter = wait
        self._healthy = False

    def __enter__(self) -> LaunchedServer:
        if self._wait_on_enter:
            super().__enter__()
            self._healthy = True
        else:
            self.start()
        return self

    def ready(self) -> None:
        """Return once the server answers /health (at once after the first time); a failed start raises."""
        if not self._healthy:
            self.wait_healthy()
            self._healthy = True

    def death_line(self, when: str = "") -> str:
        """ServerProcess's line, ending with the asyncrl key to turn where vLLM refused its share of the GPU."""
        line = super().death_line(when)
        return line + memory_refusal_hint(line, self.argv) if self.backend == "vllm" else line


class DeferredServer:
    """A server launched once the trainer has measured its footprint (trainer/memory.py), or at ``ready()`` when it
    has not: a vLLM whose share of the GPU it shares with the trainer is taken from that figure. ``launch`` builds
    the LaunchedServer then, from the figure; until it runs there is nothing to watch, so it counts as alive."""

    backend = "vllm"

    def __init__(self, launch: Callable[[TrainerMemory | None], LaunchedServer], base_url: str) -> None:
        self.launch = launch
        self.base_url = base_url.rstrip("/")
        self.server: LaunchedServer | None = None

    @property
    def log_path(self) -> Path | None:
        return None if self.server is None else self.server.log_path

    @property
    def launched(self) -> bool:
        return self.server is not None

    def start(self, memory: TrainerMemory | None = None) -> None:
        """Launch it on the trainer's ``memory`` (None: not measured) without waiting for its health (at most once):
        the trainer compiles while it boots."""
        if self.server is None:
            self.server = self.launch(memory)
            self.server.__enter__()

    def ready(self) -> None:
        self.start()
        assert self.server is not None
        self.server.ready()

    def is_alive(self) -> bool:
        return self.server is None or self.server.is_alive()

    def describe(self) -> str:
        if self.server is None:
            return f"the generation server at {self.base_url} ({KINDS[self.backend]}, not started yet)"
        return self.server.describe()

    def death_line(self) -> str:
        assert self.server is not None, "a server not started yet cannot have died"
        return self.server.death_line()

    def __enter__(self) -> DeferredServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.server is not None:
            self.server.__exit__(exc_type, exc, tb)


class AttachedServer:
    """A server somebody else runs (server.launch=false): checked at entry, never stopped by us. ``booting``:
    one that another process launched and may still be starting (a trainer rank's view of the CLI's server);
    ``ready()`` waits up to ``timeout_s`` for its health, and the launching process watches it die."""

    backend = "external"
    log_path = None
    health_timeout_s = 5.0

    def __init__(self, base_url: str, timeout_s: float, booting: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.booting = booting

    @property
    def base_urls(self) -> list[str]:
        """ServerGroup's view of one server (a trainer rank holds this handle alone)."""
        return [self.base_url]

    def is_alive(self) -> bool:
        """Gone when it refuses or fails /health; a late answer means busy, not gone (a vLLM API process
        streaming hundreds of completions can take seconds to answer; stalls are the worker timeout's job)."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=self.health_timeout_s).status_code == 200
        except httpx.TimeoutException:
            return True
        except httpx.TransportError:
            return False

    def describe(self) -> str:
        return f"the generation server at {self.base_url}"

    def death_line(self) -> str:
        return f"{self.describe()} refuses /health (server.launch=false: its log is not ours)"

    def ready(self) -> None:
        """At once, unless ``booting``: then once the server answers /health."""
        if self.booting and not wait_for_health(self.base_url, self.timeout_s):
            raise ServerStartError(
                f"server not healthy at {self.base_url} after {self.timeout_s:.0f}s (server.timeout)"
            )
        self.booting = False

    def __enter__(self) -> AttachedServer:
        if not self.is_alive():
            raise ServerStartError(f"no healthy server at {self.base_url} (server.base_url with server.launch=false)")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


def check_alive(server: Any) -> None:
    """Raise with how it ended, and its log, when a server the run depends on (launched or attached) is gone."""
    if not server.is_alive():
        raise ServerStartError(server.death_line())
