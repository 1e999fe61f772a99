"""How long a running server takes to pause (mode=keep) and resume with N requests generating, by clear_cache.

The weight sync pauses the server with every rollout in flight; this times that part alone, against any server
that speaks vLLM's API (vLLM started by `e2e.py --serve`, or the built-in one):

    python benchmarks/pause.py --url http://127.0.0.1:8000 --requests 256

Each request asks for --tokens tokens (min_tokens = max_tokens) after a random prompt of 128-512 token ids, and is
sent again as soon as it finishes, so the running count stays near --requests.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

import httpx


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
        async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=httpx.Limits(max_connections=None)) as c:
            await asyncio.gather(*(one(c, seed) for seed in range(args.requests)))

    asyncio.run(run())


def running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4, help="pauses per clear_cache setting")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of generation before the first pause")
    parser.add_argument("--vocab", type=int, default=150000, help="prompt token ids are drawn below this")
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    stop = threading.Event()
    threading.Thread(target=keep_generating, args=(args, model, stop), daemon=True).start()
    time.sleep(args.warmup)
    print("| clear_cache | running | pause ms | resume ms |\n|---|---|---|---|")
    for clear in ("true", "false"):
        for _ in range(args.rounds):
            before = running(args.url)
            started = time.perf_counter()
            httpx.post(args.url + "/pause", params={"mode": "keep", "clear_cache": clear}, timeout=60)
            paused = time.perf_counter()
            httpx.post(args.url + "/resume", timeout=60)
            resumed = time.perf_counter()
            print(f"| {clear} | {before:.0f} | {1000 * (paused - started):.0f} | {1000 * (resumed - paused):.0f} |",
                  flush=True)  # fmt: skip
            time.sleep(1.5)
    stop.set()


if __name__ == "__main__":
    main()
