"""What the vLLM transports share: IPC handles as JSON, the NCCL rendezvous address, and the watchdog that turns
a silent peer into an error instead of a hang (weights/vllm_transports.py picks the transport)."""

from __future__ import annotations

import base64
import dataclasses
import pickle
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from asyncrl.weights.transport import Background, WeightSyncError

R = TypeVar("R")
IPC_BUFFER_LIMIT = 2 << 30  # bytes: a model up to ~1B parameters in bf16 goes over as one packed buffer


def fields_of(info: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict without dataclasses.asdict's deep copy (IPC handles are not copyable)."""
    return {field.name: getattr(info, field.name) for field in dataclasses.fields(info)}


def ipc_json(update_info: dict[str, Any]) -> dict[str, Any]:
    """Move raw ``ipc_handles`` into ``ipc_handles_pickled`` (base64 pickle) so the payload is JSON."""
    handles = update_info.get("ipc_handles")
    if handles is None:
        return update_info
    out = {key: value for key, value in update_info.items() if key != "ipc_handles" and value is not None}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
    return out


def ipc_buffer_bytes(payload_bytes: int) -> int:
    """The packed IPC buffer for a sync of ``payload_bytes``: all of it, up to IPC_BUFFER_LIMIT (then chunks).

    One buffer means the server opens one CUDA IPC handle instead of one per tensor (310 for Qwen3-0.6B); the
    limit bounds the extra memory the copy costs the trainer for large models."""
    mib = 1 << 20
    return min(IPC_BUFFER_LIMIT, max(mib, -(-payload_bytes // mib) * mib))


def rendezvous_address(base_url: str) -> str:
    """This machine's address on the route to the server: where the server's workers can reach our store."""
    url = httpx.URL(base_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(url.host or "127.0.0.1"), url.port or 80))
        return str(probe.getsockname()[0])


def run_watched(what: str, fn: Callable[[], R], timeout_s: float, peer: Background[Any] | None = None) -> R:
    """Run ``fn`` (a collective that blocks until the server joins) under a watchdog: past ``timeout_s``, or as
    soon as the server's side of the exchange (``peer``) fails, raise instead of waiting forever. The stuck
    thread is left behind as a daemon; the transport cannot be used again."""
    task = Background(what, fn)
    deadline = time.monotonic() + timeout_s
    while not task.done():
        if peer is not None and peer.failed():
            peer.result(0)
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"{what} did not finish within {timeout_s:.0f} s (server.timeout): the server stopped taking part "
                "(dead or stuck); this weight-transfer group is unusable"
            )
        time.sleep(0.01)
    return task.result(0)
