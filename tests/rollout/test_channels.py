"""The worker's shared counters: the trainer's reads survive a worker killed while it held their lock, and its silence
counts from its spec."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

from asyncrl.rollout.channels import LOCK_WAIT_S, WorkerChannels


def _hold_forever(worker_counters, status, held) -> None:  # type: ignore[no-untyped-def]
    """A worker stopped inside ``send``: both locks taken, never released."""
    worker_counters.get_lock().acquire()
    status.get_lock().acquire()
    held.set()
    time.sleep(600)


def test_a_worker_killed_holding_the_counters_lock_does_not_block_the_trainers_reads():
    """kill -9 of the worker mid-``send`` left the lock held for good (POSIX semaphores are not robust) and the
    trainer blocked on it, never checking the worker's liveness: a chaos run's worker kill went unnoticed."""
    channels = WorkerChannels.create(7)
    channels.items_sent = 3
    channels.set_status("generating")
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(channels.worker_counters, channels.status, held), daemon=True)
    holder.start()
    try:
        assert held.wait(60)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        reads: list[object] = []
        reader = threading.Thread(target=lambda: reads.extend(
            [channels.items_sent, channels.inflight_at(0), channels.heartbeat > 0, channels.get_status()]))  # fmt: skip
        started = time.monotonic()
        reader.start()
        reader.join(10 * LOCK_WAIT_S)
        assert not reader.is_alive(), "the reads blocked on the dead worker's lock"
        assert reads == [3, 0, True, "generating"]
        assert time.monotonic() - started < 8 * LOCK_WAIT_S
    finally:
        if holder.is_alive():
            holder.kill()


def test_the_workers_silence_counts_from_its_spec_not_its_spawn():
    """The worker is spawned before the trainer's warm-up and the server's boot (minutes on a GPU): the no-progress
    timeout must not have run out by the time it is given its work."""
    channels = WorkerChannels.create(1)
    channels.heartbeat = time.time() - 400  # spawned long ago, silent since: waiting for its spec
    channels.send_spec({"spec": 1})
    assert time.time() - channels.heartbeat < 5
    assert channels.control_queue.get(timeout=5) == {"spec": 1}
