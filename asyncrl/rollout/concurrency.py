"""The adaptive cap on rollouts in flight, following the server's load (spec, "Concurrency" -> vLLM load).

``ConcurrencyController`` is pure: it is fed one ``LoadSample`` per poll with the worker's counts and moves
the cap. It starts at the requests that fit the KV cache at full length (``kv_cache_size_tokens //
max_model_len`` from ``vllm:cache_config_info``, at most ``max_concurrent_rollouts``). While KV usage stays
below 0.6 and nothing waits, it grows by 25%, at most once per cap-many completed rollouts; above 0.8 it is
cut by 30%, and not cut again until the rollouts in flight have drained below the new cap (running requests
are never cancelled; admission just waits). A server without ``/metrics`` leaves the cap at the ceiling.
Admission waits on the smaller of this cap and the staleness pacer's (pacing.py).
``LoadPoller`` scrapes ``/metrics`` every 5 s for it and records the rollout/vllm_* metrics.

With several servers the poller reads them all as one: the starting cap is the sum of each server's fit (each
holds its own KV cache, so the cap applies per server), KV usage is the fullest server's (the cut comes when any
nears full), request counts are summed; each server's KV usage also goes to the generation client, whose choice
of server (client.choose_server) keeps their shares of the rollouts in flight even.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from asyncrl.client import ServerLoad, metric_labels, metric_values

log = logging.getLogger(__name__)

RAISE_BELOW = 0.6
CUT_ABOVE = 0.8
RAISE_FACTOR = 1.25
CUT_FACTOR = 0.7
POLL_INTERVAL_S = 5.0


@dataclass(frozen=True)
class LoadSample:
    """One scrape of the server's load: KV usage is the maximum over engines, the counts are summed."""

    kv_cache_usage: float
    running: float
    waiting: float
    preemptions_total: float


def read_load(text: str) -> LoadSample | None:
    """The load in a /metrics text, or None when it has no vllm:kv_cache_usage_perc (not a vLLM-like server)."""
    usage = metric_values(text, "vllm:kv_cache_usage_perc")
    if not usage:
        return None
    return LoadSample(
        kv_cache_usage=max(usage),
        running=sum(metric_values(text, "vllm:num_requests_running")),
        waiting=sum(metric_values(text, "vllm:num_requests_waiting")),
        preemptions_total=sum(metric_values(text, "vllm:num_preemptions_total")),
    )


def initial_cap(text: str, max_model_len: int) -> int | None:
    """KV-cache tokens (per engine, summed over engines) // max_model_len, or None without the cache info."""
    tokens = [int(labels["kv_cache_size_tokens"]) for labels in metric_labels(text, "vllm:cache_config_info")
              if "kv_cache_size_tokens" in labels]  # fmt: skip
    if not tokens:
        return None
    return max(1, sum(tokens) // max_model_len)


class ConcurrencyController:
    """The cap sits at ``ceiling`` (max_concurrent_rollouts) until ``adapt`` gives it a starting point."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.cap = ceiling
        self.adaptive = False
        self._completed_at_change = 0
        self._cut_pending = False

    def adapt(self, initial: int, completed: int = 0) -> None:
        """Start following the load from ``initial`` rollouts in flight (clamped to [1, ceiling])."""
        self.adaptive = True
        self.cap = max(1, min(initial, self.ceiling))
        self._completed_at_change = completed

    def observe(self, load: LoadSample, inflight: int, completed: int) -> None:
        """Move the cap for one poll; ``completed`` counts every rollout finished since the start."""
        if not self.adaptive:
            return
        if self._cut_pending and inflight < self.cap:
            self._cut_pending = False
        if load.kv_cache_usage > CUT_ABOVE:
            if not self._cut_pending:
                self.cap = max(1, math.floor(self.cap * CUT_FACTOR))
                self._cut_pending = True
                self._completed_at_change = completed
            return
        grew_enough = completed - self._completed_at_change >= self.cap
        if load.kv_cache_usage < RAISE_BELOW and load.waiting == 0 and grew_enough and self.cap < self.ceiling:
            self.cap = min(self.ceiling, max(self.cap + 1, math.ceil(self.cap * RAISE_FACTOR)))
            self._completed_at_change = completed


class LoadPoller:
    """Scrapes /metrics of every server for the controller; ``counts()`` gives (rollouts in flight, rollouts
    completed); ``servers``: the generation client's loads, whose KV usage each scrape updates."""

    def __init__(
        self, servers: Sequence[ServerLoad], controller: ConcurrencyController, counts: Callable[[], tuple[int, int]],
        metrics: defaultdict[str, list[float]], timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.servers, self.controller, self.counts, self.metrics = servers, controller, counts, metrics
        self._clients = [httpx.AsyncClient(base_url=s.base_url, timeout=timeout_s) for s in servers]
        self._preemptions: float | None = None

    async def start(self, max_model_len: int) -> None:
        """First scrape: set the initial cap, or leave the cap at the ceiling when the server has no /metrics."""
        text = await self._scrape()
        initial = None if text is None else initial_cap(text, max_model_len)
        load = None if text is None else read_load(text)
        if initial is None or load is None:
            log.info("no usable /metrics: rollouts in flight capped at max_concurrent_rollouts=%d",
                     self.controller.ceiling)  # fmt: skip
            return
        self.controller.adapt(initial, self.counts()[1])
        self._record(load)  # a run shorter than one poll interval still logs the server's load
        log.info("concurrency cap starts at %d (KV cache / max_model_len %d)", self.controller.cap, max_model_len)

    async def run(self, interval_s: float = POLL_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.poll()

    async def poll(self) -> None:
        text = await self._scrape()
        load = None if text is None else read_load(text)
        if load is None:
            return
        inflight, completed = self.counts()
        self.controller.observe(load, inflight, completed)
        self._record(load)

    def _record(self, load: LoadSample) -> None:
        """The servers' load (the fullest one's KV usage, their counts summed); with several, each one's KV usage."""
        self.metrics["rollout/vllm_kv_cache_usage_frac"].append(load.kv_cache_usage)
        if len(self.servers) > 1:
            for index, server in enumerate(self.servers):
                if server.kv_cache_usage is not None:
                    self.metrics[f"rollout/server_{index}_kv_cache_usage_frac"].append(server.kv_cache_usage)
        self.metrics["rollout/vllm_running_requests"].append(load.running)
        self.metrics["rollout/vllm_queued_requests"].append(load.waiting)
        previous, self._preemptions = self._preemptions, load.preemptions_total
        preempted = 0.0 if previous is None else max(0.0, load.preemptions_total - previous)
        self.metrics["rollout/vllm_preemption_count"].append(preempted)

    async def _scrape(self) -> str | None:
        """Every server's /metrics text as one (their samples side by side, as vLLM's engines are in one), after
        giving each server's KV usage to the client; None when a server has none or a scrape failed (the next poll
        retries)."""
        texts = await asyncio.gather(*(self._scrape_one(client) for client in self._clients))
        if any(text is None for text in texts):
            return None
        for server, text in zip(self.servers, texts, strict=True):
            load = read_load(text or "")
            server.kv_cache_usage = None if load is None else load.kv_cache_usage
        return "\n".join(text or "" for text in texts)

    async def _scrape_one(self, client: httpx.AsyncClient) -> str | None:
        try:
            response = await client.get("/metrics")
        except httpx.HTTPError as error:
            log.debug("/metrics scrape of %s failed: %s", client.base_url, error)
            return None
        return response.text if response.status_code == 200 else None

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()
