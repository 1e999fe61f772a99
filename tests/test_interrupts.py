"""SIGINT and SIGTERM held back for a block (a checkpoint being written), then raised to the handlers in place."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from asyncrl.interrupts import interrupts_deferred
from asyncrl.trainer.exits import terminate_on_sigterm


@pytest.fixture
def stop_handlers():
    """asyncrl's handlers (SIGTERM and SIGINT raise KeyboardInterrupt) for the test; the previous ones after."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    terminate_on_sigterm()
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


def test_a_signal_in_the_block_waits_for_its_end_then_is_raised(stop_handlers):
    done = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            with interrupts_deferred():  # nested: the inner end hands it to the outer
                os.kill(os.getpid(), signal.SIGINT)
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers in place are back


def test_a_block_without_a_signal_ends_as_it_would_and_outside_the_main_thread_nothing_changes(stop_handlers):
    with interrupts_deferred():
        pass
    seen = []

    def other_thread() -> None:
        with interrupts_deferred():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]
