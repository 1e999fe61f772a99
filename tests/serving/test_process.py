"""Server supervision: health wait, clear startup errors, whole-group stop, no orphan after SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.serving.process import (
    PROBE_TIMEOUT_S,
    ServerProcess,
    ServerStartError,
    die_with_parent,
    free_port,
    how_it_ended,
    root_cause,
    wait_for_health,
)

# A stand-in server process: answers /health, and forks a grandchild so group cleanup is exercised.
HEALTH_SERVER = textwrap.dedent(
    """
    import http.server, os, sys, time
    port, pidfile = int(sys.argv[1]), sys.argv[2]
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(1)
    open(pidfile, "w").write(f"{os.getpid()} {child}")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); check its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _server(tmp_path: Path, port: int) -> ServerProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    return ServerProcess([sys.executable, str(script), str(port), str(tmp_path / "pids")],
                         base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / "server.log",
                         startup_timeout_s=20)  # fmt: skip


def test_waits_for_health_then_stops_the_whole_group(tmp_path):
    port = free_port()
    with _server(tmp_path, port) as server:
        assert server.is_alive()
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert all(_alive(p) for p in pids)
    assert _wait_gone(pids)


def test_busy_port_is_a_clear_error(tmp_path):
    port = free_port()
    with _server(tmp_path, port):
        with pytest.raises(ServerStartError, match=rf"127.0.0.1:{port} is already in use"):
            _server(tmp_path / "second", port).start()


def test_a_proxy_at_base_url_is_not_the_port_the_server_takes(tmp_path):
    # server.base_url at a proxy that listens (the chaos run's), the server's own --port free: it starts
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        base_url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        server = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)", "--port", str(free_port())],
                               base_url=base_url, log_path=tmp_path / "log")  # fmt: skip
        server.start()
        assert server.is_alive()
        server.stop()
        busy = ServerProcess([sys.executable, "-c", "pass"], base_url=base_url, log_path=tmp_path / "log")
        with pytest.raises(ServerStartError, match="is already in use"):  # no --port: base_url's port is the server's
            busy.start()


def test_early_exit_reports_the_log_tail(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"],
                           base_url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "log",
                           startup_timeout_s=20)  # fmt: skip
    with pytest.raises(ServerStartError, match=r"exited with code 3(.|\n)*bad flag --nope"):
        with server:
            pass


VLLM_FAILED_LOG = """\
INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.26.0
WARNING 12-01 10:00:01 [utils.py:2] retrying after ConnectionError: refused
(EngineCore_DP0 pid=7) ERROR 12-01 10:00:05 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=7) ERROR 12-01 10:00:05 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=7) ERROR 12-01 10:00:05 [core.py:708]   File "vllm/lora/layers/logits_processor.py", line 1
(EngineCore_DP0 pid=7) ERROR 12-01 10:00:05 [core.py:708]     except ValueError:
(EngineCore_DP0 pid=7) ERROR 12-01 10:00:05 [core.py:708] RuntimeError: The size of tensor a (105) must match the size of tensor b (256)
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""  # noqa: E501


def test_root_cause_is_the_first_exception_of_the_log_not_its_last_lines():
    assert root_cause(VLLM_FAILED_LOG) == (
        "RuntimeError: The size of tensor a (105) must match the size of tensor b (256)"
    )
    assert root_cause("loading\nERROR could not bind\nshutting down\n") == "ERROR could not bind"
    assert root_cause("usage: serve [--port]\nbad flag --nope\n") == "bad flag --nope"
    assert root_cause("") == "(empty log)"


def test_early_exit_shows_the_root_cause_and_where_the_log_is(tmp_path):
    script = f"print({VLLM_FAILED_LOG!r}); raise SystemExit(1)"
    server = ServerProcess([sys.executable, "-c", script], base_url=f"http://127.0.0.1:{free_port()}",
                           log_path=tmp_path / "server.log", startup_timeout_s=20)  # fmt: skip
    with pytest.raises(ServerStartError) as info:
        with server:
            pass
    assert re.sub(r"pid \d+", "pid N", str(info.value)) == (
        f"the generation server at {server.base_url} (pid N) exited with code 1 during startup: RuntimeError: The "
        f"size of tensor a (105) must match the size of tensor b (256) (log: {tmp_path / 'server.log'})"
    )


@pytest.mark.parametrize(
    ("returncode", "said"),
    [(-9, "was killed by SIGKILL"), (-15, "was killed by SIGTERM"), (1, "exited with code 1"),
     (0, "exited with code 0"), (-40, "was killed by signal 40")],
)  # fmt: skip
def test_how_a_process_ended_is_the_signal_that_killed_it_or_its_exit_code(returncode, said):
    assert how_it_ended(returncode) == said


def test_a_killed_server_is_named_with_the_signal_and_its_log_as_context_only(tmp_path):
    """The log's last line follows as context, not as a cause: a SIGKILL leaves nothing in the log about itself."""
    log = "Traceback (most recent call last):\\nKeyError: 3\\nloaded 46 tensors"  # an earlier error is no cause
    script = f"import time; print('{log}', flush=True); time.sleep(60)"
    url = f"http://127.0.0.1:{free_port()}"
    server = ServerProcess([sys.executable, "-c", script], base_url=url, log_path=tmp_path / "log")
    server.kind = "built-in"
    server.start()
    try:
        assert server.proc is not None
        deadline = time.monotonic() + 30
        while "loaded" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        assert not server.is_alive()
        assert server.death_line() == (
            f"the generation server at {url} (built-in, pid {server.proc.pid}) was killed by SIGKILL; "
            f"its log's last line: loaded 46 tensors (log: {tmp_path / 'log'})"
        )
    finally:
        server.stop()


def test_a_stopped_server_ends_on_the_sigterm_of_its_stop_not_on_the_sigkill_after_the_grace(tmp_path):
    """A hung server (SIGSTOP) gets SIGCONT after the SIGTERM, so it handles that at once."""
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                           base_url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "log")  # fmt: skip
    server.start()
    proc = server.proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    server.stop(grace_s=60)
    assert proc.returncode == -signal.SIGTERM


def test_health_wait_never_outlasts_its_deadline_on_a_server_that_never_answers():
    """A socket that accepts connections and never replies: each probe gets the time left, not a fixed 5 s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        assert not wait_for_health(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        assert time.monotonic() - started < PROBE_TIMEOUT_S / 2


def test_startup_timeout_names_the_key(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"],
                           base_url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "log",
                           startup_timeout_s=1)  # fmt: skip
    with pytest.raises(ServerStartError, match=r"server.timeout"):
        with server:
            pass


def test_server_dies_with_its_parent_even_on_sigkill(tmp_path):
    port = free_port()
    parent = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_process import _server
        from pathlib import Path
        server = _server(Path({str(tmp_path)!r}), {port})
        server.__enter__()
        print("ready", flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # the server (direct child) gets SIGTERM from the kernel; its own child is in its group and
        # dies with the group only if the server handles it - the direct child must be gone.
        assert _wait_gone(pids[:1])
    finally:
        proc.kill()
        for pid in (tmp_path / "pids").read_text().split() if (tmp_path / "pids").exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_ends_at_once(monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)  # the parent it is to die with: already gone when it looks
    preexec = die_with_parent()
    monkeypatch.undo()
    assert subprocess.run([sys.executable, "-c", "pass"], preexec_fn=preexec, timeout=60).returncode == 1
    assert subprocess.run([sys.executable, "-c", "pass"], preexec_fn=die_with_parent(), timeout=60).returncode == 0
