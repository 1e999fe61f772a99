"""The worker's shared counters: the trainer's reads and writes survive a worker killed while it held their lock, and
its silence counts from its spec."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

from asyncrl.rollout import channels as channels_module
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


def _hold_trainer_counters(trainer_counters, held) -> None:  # type: ignore[no-untyped-def]
    """A worker stopped while reading the trainer's counters (its admission reads them under their lock)."""
    trainer_counters.get_lock().acquire()
    held.set()
    time.sleep(600)


def test_a_worker_killed_reading_the_trainers_counters_does_not_block_the_trainers_writes(monkeypatch):
    """CI, session 25: the worker killed inside a read of the trainer's counters; the trainer's next weight sync
    then blocked on ``model_version = version`` for good, and the chaos run's worker kill went unnoticed."""
    monkeypatch.setattr(channels_module, "LOCK_WAIT_S", 0.1)  # each access below waits this long for the dead lock
    channels = WorkerChannels.create(7)
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_hold_trainer_counters, args=(channels.trainer_counters, held), daemon=True)
    holder.start()
    try:
        assert held.wait(60)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)

        def writes() -> None:
            channels.model_version = 4
            channels.token_allowance = 100
            channels.consume(30)
            channels.consume(12)

        writer = threading.Thread(target=writes, daemon=True)
        writer.start()
        writer.join(20 * LOCK_WAIT_S)
        assert not writer.is_alive(), "the writes blocked on the dead worker's lock"
        assert (channels.model_version, channels.token_allowance, channels.tokens_consumed) == (4, 100, 42)
    finally:
        if holder.is_alive():
            holder.kill()


def test_the_worker_side_writes_land_under_the_lock():
    channels = WorkerChannels.create(7)
    channels.send("item")
    channels.publish_inflight({3: 2, 5: 1, 4: 0})
    channels.set_status("waiting for the server")
    channels.heartbeat = 12.5
    assert channels.items_sent == 1 and channels.inflight_at(3) == 2 and channels.inflight_at(5) == 1
    assert channels.inflight_at(4) == 0 and channels.get_status() == "waiting for the server"
    assert channels.heartbeat == 12.5


def test_the_workers_silence_counts_from_its_spec_not_its_spawn():
    """The worker is spawned before the trainer's warm-up and the server's boot (minutes on a GPU): the no-progress
    timeout must not have run out by the time it is given its work."""
    channels = WorkerChannels.create(1)
    channels.heartbeat = time.time() - 400  # spawned long ago, silent since: waiting for its spec
    channels.send_spec({"spec": 1})
    assert time.time() - channels.heartbeat < 5
    assert channels.control_queue.get(timeout=5) == {"spec": 1}
