"""SIGINT and SIGTERM held back while a checkpoint is written.

The CLI stops a run with SIGTERM, which each process turns into KeyboardInterrupt (trainer/exits.py). Raised inside
``torch.distributed.checkpoint``'s save, it came out as DCP's own RuntimeError, a traceback instead of the
interrupted run's line and resume command, and the ranks' shards half written. Held until the save ends, the signal
costs a second or two of saving and leaves a whole checkpoint to resume from; the handler that was in place then
gets it as it would have.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """For the block, SIGINT and SIGTERM are recorded instead of handled; at its end the first one recorded is raised
    again, to the handlers that were in place. Outside the main thread (where signals cannot be caught) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {number: signal.getsignal(number) for number in HELD}
    for number in HELD:
        signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if received:
        signal.raise_signal(received[0])
