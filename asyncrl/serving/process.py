"""Lifecycle of the generation server subprocess: start, wait for health, stop; never an orphan.

The server runs in its own process group (so its children go with it) with its log in the run directory.
If the CLI dies, even by SIGKILL, the kernel's parent-death signal terminates the server (``die_with_parent``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from asyncrl.parent import die_with_parent


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message carries the end of its log."""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_in_use(host: str, port: int) -> str:
    """The one wording of a port another process holds: a run's check, a server's start and the engine's own."""
    return f"{host}:{port} is already in use (another server?)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_EXCEPTION = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt): \S")
_QUIET = re.compile(r"\b(?:DEBUG|INFO|WARN|WARNING)\b")


def root_cause(log: str) -> str:
    """The line of a failed server's log that says why: the first exception raised (a traceback ends on it, and a
    chained one's first is the cause; vLLM's last line only says "See root cause above"), else the first line
    logged at ERROR, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        match = _EXCEPTION.search(line)
        if match is not None and not _QUIET.search(line[: match.start()]):
            return line[match.start() :][:500]
    errors = [line for line in lines if "ERROR" in line]
    return (errors or lines or ["(empty log)"])[0 if errors else -1][:500]


def last_line(log: str) -> str:
    """The last line of a log that says anything."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return (lines or ["(empty log)"])[-1][:500]


def how_it_ended(returncode: int) -> str:
    """A process's end from its return code: the signal that killed it (a negative code), else its exit code."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:  # a real-time signal has no name
        name = f"signal {-returncode}"
    return f"was killed by {name}"


PROBE_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.25


def wait_for_health(base_url: str, timeout_s: float, check: Callable[[], None] = lambda: None) -> bool:
    """Poll ``base_url``/health until it answers 200 (True) or ``timeout_s`` passes (False); ``check`` runs
    between polls and raises when waiting is pointless (the server process exited). No probe or pause outlasts
    the deadline: each gets at most the time left."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while (left := deadline - time.monotonic()) > 0:
            check()
            try:
                response = client.get(f"{base_url.rstrip('/')}/health", timeout=min(PROBE_TIMEOUT_S, left))
                if response.status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(max(0.0, min(POLL_INTERVAL_S, deadline - time.monotonic())))
    return False


def listen_address(argv: Sequence[str], base_url: str) -> tuple[str, int]:
    """Where the server will listen: its command's last ``--host`` and ``--port`` (as argparse reads them), else
    ``base_url``'s. They differ when server.base_url is a proxy in front of the launched server (the chaos run's)."""
    url = httpx.URL(base_url)
    host, port = url.host or "127.0.0.1", url.port or 80
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--host":
            host = value
        elif flag == "--port":
            port = int(value)
    return host, port


class ServerProcess:
    """A supervised server subprocess; use as a context manager so it is always stopped."""

    kind: str | None = None
    """What serves, for the lines that name the server (LaunchedServer: vLLM or built-in)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        base_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.argv = list(argv)
        self.base_url = base_url.rstrip("/")
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        host, port = listen_address(self.argv, self.base_url)
        if not port_is_free(host, port):
            raise ServerStartError(
                f"{port_in_use(host, port)}: stop it, choose a free port with server.port=N, or attach to it "
                f"with server.launch=false server.base_url={self.base_url}"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its whole life
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=die_with_parent()
            )
        finally:
            log.close()

    def wait_healthy(self) -> None:
        if not wait_for_health(self.base_url, self.startup_timeout_s, self._check_running):
            raise ServerStartError(
                f"server not healthy at {self.base_url} after {self.startup_timeout_s:.0f}s (server.timeout): "
                + self.log_summary()
            )

    def _check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerStartError(self.death_line(" during startup"))

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str:
        """How lines name it: the generation server at its address, with what serves and its pid."""
        facts = ([self.kind] if self.kind else []) + ([f"pid {self.proc.pid}"] if self.proc is not None else [])
        return f"the generation server at {self.base_url}" + (f" ({', '.join(facts)})" if facts else "")

    def death_line(self, when: str = "") -> str:
        """The one line that says it ended (every report of a server's death is this line): ``describe()``, how it
        ended (``how_it_ended``) and ``when``, then its log. A killed server logged nothing of its end, so its log's
        last line is only context; an exit's cause is the line ``root_cause`` picks."""
        code = None if self.proc is None else self.proc.poll()
        assert code is not None, "death_line() is for a server that ended"
        if code < 0:
            return f"{self.describe()} {how_it_ended(code)}{when}; its log's last line: {self.log_summary(last_line)}"
        return f"{self.describe()} {how_it_ended(code)}{when}: {self.log_summary()}"

    def log_summary(self, pick: Callable[[str], str] = root_cause) -> str:
        """The line of its log that ``pick`` chooses (the root cause), and where the whole log is."""
        try:
            return f"{pick(self.log_path.read_text(errors='replace'))} (log: {self.log_path})"
        except OSError:
            return f"(no log at {self.log_path})"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after ``grace_s``. SIGCONT follows the
        SIGTERM: a stopped (hung) server handles it now instead of waiting out the grace."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGCONT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=grace_s)
        self.proc = None

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
