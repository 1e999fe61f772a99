"""The rollout worker process against a real built-in server: it stops when the trainer says so, even while
admission holds it back because nobody consumes its samples."""

from __future__ import annotations

import time
from pathlib import Path

from asyncrl.config import compose, to_config
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.spawn import send_spec, spawn_worker
from asyncrl.rollout.worker import WorkerSpec
from asyncrl.server.command import served_model_name
from asyncrl.trainer.setup import prepare


def test_a_worker_blocked_on_backpressure_stops_promptly(tiny_server, random_tiny_model_dir, arithmetic_data_dir):
    config = to_config(compose([
        f"model.name_or_path={random_tiny_model_dir}", f"data.path={Path(arithmetic_data_dir) / 'train.jsonl'}",
        "data.eval_path=null", "reward=length", "server.launch=false", f"server.base_url={tiny_server.base_url}",
    ]))  # fmt: skip
    prepared = prepare(config)
    channels = WorkerChannels.create(64)  # a small allowance, and no trainer consumes: admission soon waits
    spec = WorkerSpec(
        config=config, tokenizer=prepared.tokenizer, dataset=prepared.dataset, reward_sources=prepared.reward_sources,
        loop_cls=prepared.loop_cls, advantage_fn=prepared.advantage_fn, base_url=tiny_server.base_url,
        model_name=served_model_name(config), max_model_len=256, adapter_prefix=None, start_prompt_index=0,
        total_prompts=None,
    )  # fmt: skip
    worker = spawn_worker(channels)
    send_spec(spec, channels)
    try:
        deadline = time.monotonic() + 60
        while "backpressure" not in channels.get_status():
            assert time.monotonic() < deadline, f"the worker never waited on admission: {channels.get_status()!r}"
            assert worker.is_alive(), "the worker exited early"
            time.sleep(0.1)
        stopped = time.monotonic()
        channels.stop()
        worker.join(timeout=10)
        assert not worker.is_alive() and worker.exitcode == 0
        assert time.monotonic() - stopped < 3.0  # it was waiting for room that would never come
        assert channels.failure() is None
    finally:
        if worker.is_alive():
            worker.kill()


def test_a_worker_spawned_ahead_of_its_spec_ends_when_stopped_without_one():
    """The trainer spawns the worker before the server is up; a run that fails before sending the spec stops it."""
    channels = WorkerChannels.create(1)
    worker = spawn_worker(channels)
    try:
        time.sleep(0.5)
        assert worker.is_alive()  # waiting for its spec
        channels.stop()
        worker.join(timeout=30)  # its imports may still be running
        assert not worker.is_alive() and worker.exitcode == 0 and channels.failure() is None
    finally:
        if worker.is_alive():
            worker.kill()
