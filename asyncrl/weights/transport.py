"""What every weight-sync transport shares: the ``Transport`` interface, its error, step bookkeeping, and
``Background``, the thread an HTTP call runs on while the round goes on."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from asyncrl.client import Control
from asyncrl.serving.process import ServerStartError

R = TypeVar("R")


class WeightSyncError(RuntimeError):
    """A weight-sync step failed; the message names it."""


class Transport(ABC):
    """The data plane of one weight-sync backend; ``WeightSync`` makes the round's control calls around it."""

    model: torch.nn.Module | None = None
    session = True
    """Whether the round opens vLLM's weight-update session (/start_weight_update ... /finish_weight_update)."""

    def init(self, control: Control, model: torch.nn.Module) -> None:
        """Rendezvous with the server, POST /init_weight_transfer_engine included. ``model`` is what the rounds will
        push (same names and shapes), for transports that plan from it up front."""
        control.init_weight_transfer({})

    def stage(self, model: torch.nn.Module) -> None:
        """Prepare this round's weights before the server pauses (the pause should cover loading only)."""
        self.model = model

    @abstractmethod
    def send(self, control: Control) -> float:
        """Between start and finish: POST /update_weights and move the tensors. Returns the seconds spent
        waiting for the server to take them after they were sent (the barrier)."""

    def discard(self) -> None:
        """Drop what ``stage`` prepared; runs after every round, failed or not."""
        self.model = None

    def close(self, control: Control) -> None:  # noqa: B027 - an optional hook: most transports hold nothing
        """Release the transport at the end of the run."""


def run_step(step: str, fn: Callable[..., R], *args: Any) -> R:
    """Call ``fn``; any failure becomes a WeightSyncError naming ``step``, but the server's own death or hang
    (ServerStartError, from the control group's watch) stays what it is: the sync did not fail, its server did."""
    try:
        return fn(*args)
    except (WeightSyncError, ServerStartError):
        raise
    except Exception as exc:
        raise WeightSyncError(f"weight sync failed at {step}: {exc}") from exc


class Background(Generic[R]):
    """``fn(*args)`` on a daemon thread (an HTTP call that blocks while its peer receives)."""

    def __init__(self, what: str, fn: Callable[..., R], *args: Any) -> None:
        self.what = what
        self._value: R | None = None
        self._error: BaseException | None = None
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._run, args=(fn, args, device), name=what, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., R], args: tuple[Any, ...], device: int | None) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            self._value = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller by result()
            self._error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for it; whether it is done."""
        self._thread.join(timeout_s)
        return self.done()

    def failed(self) -> bool:
        return self.done() and self._error is not None

    def result(self, timeout_s: float) -> R:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightSyncError(f"{self.what}: no answer within {timeout_s:.0f} s (server.timeout)")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
