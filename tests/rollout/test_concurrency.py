"""The adaptive concurrency cap: scripted load sequences, /metrics parsing, and the poller on a real server."""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from asyncrl.client import GenerationClient, SamplingParams, ServerLoad
from asyncrl.rollout.concurrency import ConcurrencyController, LoadPoller, LoadSample, initial_cap, read_load
from asyncrl.serving.process import ServerProcess, free_port


def load(usage: float, waiting: float = 0.0) -> LoadSample:
    return LoadSample(kv_cache_usage=usage, running=0.0, waiting=waiting, preemptions_total=0.0)


def trajectory(controller: ConcurrencyController, script: list[tuple[float, float, int, int]]) -> list[int]:
    """Feed (kv usage, waiting, in flight, completed) polls; return the cap after each."""
    caps = []
    for usage, waiting, inflight, completed in script:
        controller.observe(load(usage, waiting), inflight, completed)
        caps.append(controller.cap)
    return caps


def adaptive(initial: int, ceiling: int = 512) -> ConcurrencyController:
    controller = ConcurrencyController(ceiling)
    controller.adapt(initial)
    return controller


def test_the_cap_grows_by_a_quarter_once_per_cap_many_completions_while_idle():
    caps = trajectory(adaptive(16), [
        (0.3, 0, 16, 10),   # 10 < 16 completions since the start: no growth yet
        (0.3, 0, 16, 16),   # 16 completed: 16 -> 20
        (0.3, 0, 20, 30),   # 14 since the last change < 20: stay
        (0.3, 0, 20, 36),   # 20 since the change: 20 -> 25
        (0.3, 3, 25, 80),   # requests waiting: no growth
        (0.7, 0, 25, 90),   # usage between 0.6 and 0.8: hold
        (0.5, 0, 25, 90),   # idle again and 54 since the change: 25 -> 32 (ceil of 31.25)
    ])  # fmt: skip
    assert caps == [16, 20, 20, 25, 25, 25, 32]


def test_a_cut_by_30_percent_waits_for_the_pool_to_drain_before_another():
    caps = trajectory(adaptive(100), [
        (0.85, 0, 100, 5),  # over 0.8: 100 -> 70
        (0.9, 0, 95, 6),    # still 95 in flight >= 70: no second cut
        (0.95, 0, 71, 30),  # 71 >= 70: still waiting for the drain
        (0.9, 0, 69, 40),   # drained below 70: cut again, 70 -> 49
        (0.5, 0, 40, 60),   # idle but only 20 completed since the cut: stay
        (0.5, 0, 40, 89),   # 49 completed since the cut: 49 -> 62
    ])  # fmt: skip
    assert caps == [70, 70, 70, 49, 49, 62]


def test_the_cap_is_bounded_by_the_ceiling_and_one():
    assert trajectory(adaptive(600, ceiling=64), [(0.1, 0, 0, 1000)]) == [64]
    assert trajectory(adaptive(1), [(0.99, 0, 1, 0), (0.99, 0, 0, 0)]) == [1, 1]
    static = ConcurrencyController(64)
    assert trajectory(static, [(0.99, 0, 64, 100), (0.1, 0, 0, 1000)]) == [64, 64] and not static.adaptive


METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25
vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.5
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 4.0
vllm:num_requests_waiting{model_name="m",engine="0"} 1.0
vllm:num_preemptions_total{model_name="m",engine="0"} 7.0
vllm:cache_config_info{block_size="16",kv_cache_size_tokens="81920",engine="0"} 1.0
"""


def test_metrics_parsing_takes_the_fullest_engine_and_sums_counts():
    assert read_load(METRICS) == LoadSample(kv_cache_usage=0.5, running=7.0, waiting=1.0, preemptions_total=7.0)
    assert initial_cap(METRICS, max_model_len=4096) == 20
    assert read_load("vllm:num_requests_running 1\n") is None and initial_cap("", 4096) is None


@pytest.fixture(scope="module")
def small_server(random_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The built-in server with 4 rows x 64 tokens of KV cache: an initial cap of 4."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(random_tiny_model_dir), "--port", str(port),
            "--device", "cpu", "--max-num-seqs", "4", "--max-model-len", "64", "--served-model-name", "m"]  # fmt: skip
    log = tmp_path_factory.mktemp("concurrency-server") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as process:  # fmt: skip
        yield process


def test_the_poller_follows_the_built_in_servers_real_metrics(small_server):
    """6 requests on 4 rows: the polls see rows running and requests queued; once idle the cap grows."""

    async def run() -> tuple[ConcurrencyController, dict[str, list[float]], int]:
        controller, metrics = ConcurrencyController(ceiling=512), defaultdict(list)
        state = {"inflight": 0, "completed": 0}
        servers = [ServerLoad(small_server.base_url)]
        poller = LoadPoller(servers, controller, lambda: (state["inflight"], state["completed"]), metrics)
        await poller.start(max_model_len=64)
        assert controller.adaptive and controller.cap == 4 and servers[0].kv_cache_usage == 0.0
        assert metrics["rollout/vllm_kv_cache_usage_frac"] == [0.0]  # the first scrape is logged too: a run
        # shorter than one poll interval still shows the server's load
        polls = 0
        async with GenerationClient(small_server.base_url, "m", timeout_s=60) as client:
            params = SamplingParams(max_tokens=20, logprobs=None, seed=1)
            requests = asyncio.gather(*(client.complete([4, 30, 31], params) for _ in range(6)))
            state["inflight"] = 6
            while not requests.done():
                await asyncio.sleep(0.01)
                await poller.poll()
                polls += 1
            await requests
        state.update(inflight=0, completed=6)
        await poller.poll()  # idle, 6 >= 4 completed since the start: the cap grows by a quarter
        await poller.aclose()
        return controller, metrics, polls + 2  # the first scrape, the polls while busy, the idle one

    controller, metrics, polls = asyncio.run(run())
    assert max(metrics["rollout/vllm_running_requests"]) > 0 and max(metrics["rollout/vllm_queued_requests"]) > 0
    usage = metrics["rollout/vllm_kv_cache_usage_frac"]
    assert max(usage) < 0.6 and usage[-1] == 0
    assert len(metrics["rollout/vllm_preemption_count"]) == polls
    assert controller.cap == 5


def test_several_servers_each_log_their_kv_usage(small_server):
    """Two servers (the same one twice here): the cap starts at both KV caches' fit, each one's usage is logged."""

    async def run() -> tuple[ConcurrencyController, dict[str, list[float]]]:
        controller, metrics = ConcurrencyController(ceiling=512), defaultdict(list)
        servers = [ServerLoad(small_server.base_url), ServerLoad(small_server.base_url)]
        poller = LoadPoller(servers, controller, lambda: (0, 0), metrics)
        await poller.start(max_model_len=64)
        await poller.aclose()
        return controller, metrics

    controller, metrics = asyncio.run(run())
    assert controller.cap == 8  # 4 rows of 64 tokens on each
    assert metrics["rollout/server_0_kv_cache_usage_frac"] == metrics["rollout/server_1_kv_cache_usage_frac"] == [0.0]


def test_without_metrics_the_cap_stays_at_max_concurrent_rollouts():
    async def run() -> ConcurrencyController:
        controller = ConcurrencyController(ceiling=64)
        servers = [ServerLoad(f"http://127.0.0.1:{free_port()}")]
        poller = LoadPoller(servers, controller, lambda: (0, 0), defaultdict(list), 1.0)
        await poller.start(max_model_len=64)
        await poller.poll()
        await poller.aclose()
        return controller

    controller = asyncio.run(run())
    assert controller.cap == 64 and not controller.adaptive
