"""An ASGI app served by uvicorn in a thread of this process, on a loopback port: the reward models' scoring endpoint
beside the trainer (rewards/endpoint.py), and the tests' scripted servers.

The socket is bound here and handed to uvicorn, so no other process can take the port between choosing and binding.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

STARTUP_TIMEOUT_S = 30.0


@contextlib.contextmanager
def serve_in_thread(app: Any, name: str = "asyncrl-app") -> Iterator[str]:
    """``app`` on 127.0.0.1, in a daemon thread called ``name``, until the block ends; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"{name}: the server in this process did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
