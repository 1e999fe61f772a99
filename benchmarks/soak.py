"""The built-in server under load for minutes: 4x its --max-num-seqs requests at once with random sampling
parameters, and, every few seconds, a pause (abort, wait or keep; cache cleared or not), sometimes a weight update
(the model's own weights and a perturbed copy in turn), and a resume. Loopback only; bounded by --minutes and
--max-requests.

It reports: requests by HTTP status (anything but 200, a refused connection or the server's exit is a failure: every
request is valid), the finish reasons,
request latency percentiles (p50/p90/p99/max; a request caught by a pause waits it out), pause/update/resume call
times, and the server's resident memory (VmRSS, sampled every 2 s) after the warm-up (the first --warmup-frac of the
run): the range of its --window-minutes means relative to their lowest, which must stay within 10%, its least-squares
slope (a leak climbs steadily; the allocator's high-water marks do not), and the range of the single samples. Why
window means: within any 2 minutes the samples swing by up to 7% as the allocator takes and returns memory for the
batch of the moment (session 15's run: 464-512 MB among samples whose 2-minute means stayed within 1.5%), which a
min-max of single samples reads as growth; a leak moves the means.

    python benchmarks/soak.py --minutes 10                  # the RESULTS.md run (tiny model, CPU)
    python benchmarks/soak.py --minutes 1 --max-num-seqs 8  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.client import TOKEN_ENV, ControlClient  # noqa: E402
from asyncrl.serving.process import free_port  # noqa: E402

MODEL = REPO / "asyncrl" / "assets" / "tiny-arith"


def start_server(args: argparse.Namespace, weights_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "asyncrl.engine", "--model", str(MODEL), "--host", "127.0.0.1", "--port",
               str(port), "--max-num-seqs", str(args.max_num_seqs), "--weights-dir", str(weights_dir)]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)}
        )


def weight_files(weights_dir: Path, seed: int) -> list[str]:
    """The model's weights and a copy with 1e-3 noise, each a file the server may load (inside --weights-dir)."""
    original = load_file(str(MODEL / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    noisy = {k: v + 1e-3 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in original.items()}
    paths = []
    for name, tensors in (("original", original), ("noisy", noisy)):
        path = weights_dir / f"{name}.safetensors"
        save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(path))
        paths.append(str(path))
    return paths


def random_body(rng: random.Random, model: str, vocab: int, max_model_len: int) -> dict:
    """A completion request with random sampling parameters (each one the built-in server supports)."""
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 48))]
    max_tokens = rng.randint(1, min(64, max_model_len - len(prompt)))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": rng.choice([0.0, 0.3, 1.0, 1.7]),
            "top_p": rng.choice([None, 0.5, 0.9, 1.0]), "top_k": rng.choice([None, -1, 1, 5, 50]),
            "min_p": rng.choice([None, 0.0, 0.05, 0.2]), "repetition_penalty": rng.choice([None, 0.9, 1.0, 1.3]),
            "seed": rng.choice([None, rng.randrange(2**31)]), "logprobs": rng.choice([None, 0, 1, 5]),
            "min_tokens": rng.randint(0, max_tokens), "ignore_eos": rng.random() < 0.5,
            "stop_token_ids": rng.choice([None, [rng.randrange(3, vocab)]])}  # fmt: skip
    return {k: v for k, v in body.items() if v is not None}


class Load:
    """``concurrency`` request loops; each records its status, finish reason and latency."""

    def __init__(self, url: str, token: str, concurrency: int, max_requests: int, model: str, vocab: int,
                 max_len: int) -> None:  # fmt: skip
        self.url, self.token, self.concurrency, self.max_requests = url, token, concurrency, max_requests
        self.model, self.vocab, self.max_len = model, vocab, max_len
        self.statuses: Counter[str] = Counter()
        self.finish: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.tokens = 0
        self.stop = threading.Event()
        self.rejecting: list[list[float]] = []
        """[start, end] of each abort or wait pause: vLLM's semantics reject requests (503) until the resume."""
        self.rejected_while_paused = 0

    def _while_paused(self, started: float, ended: float) -> bool:
        return any(start <= ended and (end is None or end >= started) for start, end in self.rejecting)

    async def _loop(self, client: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set() and sum(self.statuses.values()) < self.max_requests:
            started = time.monotonic()
            try:
                response = await client.post(
                    "/v1/completions", json=random_body(rng, self.model, self.vocab, self.max_len)
                )
            except httpx.HTTPError as exc:
                self.statuses[type(exc).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            if response.status_code == 503 and self._while_paused(started, time.monotonic()):
                self.rejected_while_paused += 1
                await asyncio.sleep(0.2)  # a client backs off until the resume
                continue
            self.statuses[str(response.status_code)] += 1
            if response.status_code == 200:
                self.latencies.append(time.monotonic() - started)
                self.tokens += response.json()["usage"]["completion_tokens"]
                for choice in response.json()["choices"]:
                    self.finish[choice["finish_reason"]] += 1

    def run(self) -> None:
        async def main() -> None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            headers = {"Authorization": f"Bearer {self.token}"}
            async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits, headers=headers) as client:
                await asyncio.gather(*(self._loop(client, seed) for seed in range(self.concurrency)))

        asyncio.run(main())


def control_loop(control: ControlClient, paths: list[str], load: Load, rng: random.Random,
                 calls: dict[str, list[float]]) -> None:  # fmt: skip
    """Every 3-10 s: pause (random mode and cache clearing), a weight update two times in three, resume."""
    version = 0
    control.init_weight_transfer({})
    while not load.stop.wait(rng.uniform(3, 10)):
        mode = rng.choice(["abort", "wait", "keep"])
        started = time.monotonic()
        window = [started, None]
        if mode != "keep":
            load.rejecting.append(window)
        control.pause(mode, clear_cache=rng.random() < 0.5)
        calls[f"pause_{mode}_s"].append(time.monotonic() - started)
        try:
            if rng.random() < 2 / 3:
                version += 1
                started = time.monotonic()
                control.start_weight_update()
                control.update_weights({"path": paths[version % 2], "dtype": "float32"})
                control.finish_weight_update(str(version))
                calls["weight_update_s"].append(time.monotonic() - started)
            time.sleep(rng.uniform(0, 1))
        finally:
            started = time.monotonic()
            control.resume()
            window[1] = time.monotonic()
            calls["resume_s"].append(window[1] - started)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def window_means(samples: list[tuple[float, float]], start_s: float, window_s: float) -> list[float]:
    """The means of (seconds, MB) ``samples`` over consecutive ``window_s`` windows from ``start_s`` (a last,
    partial window counts when it holds at least half a window of samples' time)."""
    windows: dict[int, list[float]] = {}
    for t, mb in samples:
        if t >= start_s:
            windows.setdefault(int((t - start_s) // window_s), []).append(mb)
    last_t = max((t for t, _ in samples), default=start_s)
    whole = [i for i in sorted(windows) if (i + 0.5) * window_s <= last_t - start_s]
    return [statistics.fmean(windows[i]) for i in whole]


def spread(values: list[float]) -> float:
    """(max - min) / min: how far apart the figures are, relative to the lowest."""
    return (max(values) - min(values)) / min(values)


def percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3), "max": round(max(values), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--load-factor", type=int, default=4, help="requests at once = this x --max-num-seqs")
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--warmup-frac", type=float, default=0.2)
    parser.add_argument("--window-minutes", type=float, default=2.0, help="resident memory is judged on its means "
                        "over windows this long after the warm-up")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    token = os.environ.setdefault(TOKEN_ENV, secrets.token_hex(16))
    weights_dir = Path(tempfile.mkdtemp(prefix="asyncrl-soak-"))
    port = free_port()
    log = weights_dir / "server.log"
    server = start_server(args, weights_dir, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        control = ControlClient(url, timeout_s=120, token=token)
        control.wait_healthy(120, is_alive=lambda: server.poll() is None)
        config = json.loads((MODEL / "config.json").read_text())
        load = Load(url, token, args.load_factor * args.max_num_seqs, args.max_requests,
                    control.served_model_name(), config["vocab_size"], control.max_model_len())  # fmt: skip
        calls: dict[str, list[float]] = {k: [] for k in ("pause_abort_s", "pause_wait_s", "pause_keep_s",
                                                         "weight_update_s", "resume_s")}  # fmt: skip
        rng = random.Random(args.seed)
        controller = threading.Thread(target=control_loop, args=(control, weight_files(weights_dir, args.seed),
                                                                 load, rng, calls), daemon=True)  # fmt: skip
        loader = threading.Thread(target=load.run, daemon=True)
        started = time.monotonic()
        loader.start()
        controller.start()
        rss: list[tuple[float, float]] = []
        while time.monotonic() - started < args.minutes * 60 and loader.is_alive() and server.poll() is None:
            rss.append((time.monotonic() - started, rss_mb(server.pid)))
            time.sleep(2)
        load.stop.set()
        loader.join(timeout=180)
        controller.join(timeout=60)
        elapsed = time.monotonic() - started
        after = [mb for t, mb in rss if t >= args.warmup_frac * elapsed]
        means = window_means(rss, args.warmup_frac * elapsed, args.window_minutes * 60)
        result = {
            "minutes": round(elapsed / 60, 2), "max_num_seqs": args.max_num_seqs, "concurrency": load.concurrency,
            "server_alive": server.poll() is None, "requests": dict(load.statuses), "finish_reasons": dict(load.finish),
            "rejected_while_paused_by_design": load.rejected_while_paused,
            "failures": sum(n for s, n in load.statuses.items() if s != "200"),
            "http_5xx": sum(n for s, n in load.statuses.items() if s.startswith("5")),
            "tokens_per_s": round(load.tokens / elapsed, 1), "latency_s": percentiles(load.latencies),
            "rss_mb_start": round(rss[0][1], 1), "rss_mb_after_warmup_min": round(min(after), 1),
            "rss_mb_after_warmup_max": round(max(after), 1), "rss_mb_end": round(rss[-1][1], 1),
            "rss_window_means_mb": [round(mb, 1) for mb in means],
            "rss_window_means_spread": round(spread(means), 4) if means else None,
            "rss_samples_spread_after_warmup": round(spread(after), 4),
            "rss_mb_per_min_after_warmup": round(statistics.linear_regression(
                [t for t, _ in rss if t >= args.warmup_frac * elapsed], after).slope * 60, 2),
            "rss_mb_every_10s": [round(mb) for t, mb in rss[::5]],
            "calls": {k: {"count": len(v), **percentiles(v)} for k, v in calls.items()},
        }  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    flat = result["rss_window_means_spread"] is not None and result["rss_window_means_spread"] <= 0.10
    ok = result["server_alive"] and result["failures"] == 0 and flat
    print("PASS" if ok else f"FAIL (log: {log})")
    if ok:
        shutil.rmtree(weights_dir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
