"""How long a running server takes to pause (mode=keep) and resume with N requests generating, by clear_cache.

The weight sync pauses the server with every rollout in flight; this times that part alone, against any server
that speaks vLLM's API (vLLM started by `e2e.py --serve`, or the built-in one):

    python benchmarks/pause.py --url http://127.0.0.1:8000 --requests 256

Each request asks for --tokens tokens (min_tokens = max_tokens) after a random prompt of 128-512 token ids, and is
sent again as soon as it finishes, so the running count stays near --requests. Besides the pause and resume calls,
each round reports what the pause costs generation afterwards: tokens generated in the --window seconds after
resume against the same window just before the pause (vLLM's ``generation_tokens_total``), which is where the
re-prefill of every preempted request shows (clear_cache=true), and the preemptions the round added. Requests
carry $ASYNCRL_SERVER_TOKEN as a bearer token when it is set (a server asyncrl launched asks for it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time

import httpx

PREEMPTIONS = "vllm:num_preemptions_total"
HEADERS = (
    {"Authorization": f"Bearer {os.environ['ASYNCRL_SERVER_TOKEN']}"} if "ASYNCRL_SERVER_TOKEN" in os.environ else {}
)


def keep_generating(args: argparse.Namespace, model: str, stop: threading.Event) -> None:
    """Keep ``args.requests`` requests running until ``stop`` is set."""

    async def one(client: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = [rng.randrange(2, args.vocab) for _ in range(rng.randint(128, 512))]
            body = {"model": model, "prompt": prompt, "max_tokens": args.tokens, "min_tokens": args.tokens,
                    "logprobs": 0, "seed": seed}  # fmt: skip
            await client.post("/v1/completions", json=body)

    async def run() -> None:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits, headers=HEADERS) as c:
            await asyncio.gather(*(one(c, seed) for seed in range(args.requests)))

    asyncio.run(run())


def metric(url: str, name: str) -> float:
    """One of vLLM's Prometheus counters or gauges, summed over its label sets (nan when absent)."""
    values = [float(line.split()[-1]) for line in httpx.get(url + "/metrics", headers=HEADERS).text.splitlines()
              if line.startswith(name) and line[len(name)] in " {"]  # fmt: skip
    return sum(values) if values else float("nan")


def tokens_in(url: str, seconds: float) -> float:
    """Tokens the server generates in the next ``seconds``."""
    before = metric(url, "vllm:generation_tokens_total")
    time.sleep(seconds)
    return metric(url, "vllm:generation_tokens_total") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4, help="pauses per clear_cache setting")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of generation before the first pause")
    parser.add_argument("--vocab", type=int, default=150000, help="prompt token ids are drawn below this")
    parser.add_argument("--window", type=float, default=1.5, help="seconds of generation counted before/after")
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    stop = threading.Event()
    threading.Thread(target=keep_generating, args=(args, model, stop), daemon=True).start()
    time.sleep(args.warmup)
    print("| clear_cache | running | pause ms | resume ms | tokens before | tokens after | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for clear in ("true", "false"):
        for _ in range(args.rounds):
            before_tokens = tokens_in(args.url, args.window)
            running, preempted = metric(args.url, "vllm:num_requests_running"), metric(args.url, PREEMPTIONS)
            started = time.perf_counter()
            pause = {"mode": "keep", "clear_cache": clear}
            httpx.post(args.url + "/pause", params=pause, headers=HEADERS, timeout=60).raise_for_status()
            paused = time.perf_counter()
            httpx.post(args.url + "/resume", headers=HEADERS, timeout=60).raise_for_status()
            resumed = time.perf_counter()
            after_tokens = tokens_in(args.url, args.window)
            print(f"| {clear} | {running:.0f} | {1000 * (paused - started):.0f} | {1000 * (resumed - paused):.0f} | "
                  f"{before_tokens:.0f} | {after_tokens:.0f} | {metric(args.url, PREEMPTIONS) - preempted:.0f} |",
                  flush=True)  # fmt: skip
    stop.set()


if __name__ == "__main__":
    main()
