"""The built-in server's engine alone, then (``--http``) through HTTP: generated tokens/s, ms per decoding step and
CPU ms per generated token (the server process's, its engine thread's and its HTTP event loop's), N requests at once.

Random weights built from a config (nothing downloaded); every request asks for top-8 logprobs, temperature 1,
ignores EOS and stops at its own length, so each run generates the same number of tokens. Steps that also
prefill joining rows are timed apart from pure decoding steps. A second measurement times the KV cache alone:
one decoding step's cache updates over all layers (rows x the mean final width), transformers' DynamicLayer
(concatenation) against asyncrl's SlackLayer (in place). With ``--http`` the same requests then go through the
HTTP app (uvicorn on loopback in this process, a fresh engine on the same model) from a client process that posts
them to /v1/completions as the rollout worker does (``GenerationClient.complete``), so one run prints
engine-alone and through-HTTP tokens/s (``http_*`` keys). With $OUT set, the results also go to
$OUT/builtin_server.json:

    python benchmarks/builtin_server.py                                   # CPU, tiny model, 32 requests
    python benchmarks/builtin_server.py --requests 256 --completion-min 48 --completion-max 112 --http
    python benchmarks/builtin_server.py --device cuda --model qwen3-0.6b --requests 256 --completion-min 48 \
        --completion-max 112 --http                                       # the H200 run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import uvicorn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e import word_tokenizer  # noqa: E402  (benchmarks/, the script's folder, is on sys.path)

from asyncrl.client import GenerationClient  # noqa: E402
from asyncrl.engine.api import BuiltinServer, build_app, prepare_serving_process  # noqa: E402
from asyncrl.engine.cache import SlackLayer  # noqa: E402
from asyncrl.engine.core import Engine, EngineConfig  # noqa: E402
from asyncrl.engine.rows import GenerationRequest  # noqa: E402
from asyncrl.sampling import SamplingParams  # noqa: E402
from asyncrl.serving.process import free_port  # noqa: E402

MODELS = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}  # fmt: skip


class TimedEngine(Engine):
    """The engine, recording each step's wall time and whether rows joined in it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_times: list[tuple[float, float, bool]] = []
        """(start, seconds, whether rows joined) of each step; starts on ``time.perf_counter``'s clock."""
        self.thread = self._thread
        self.profiler: torch.profiler.profile | None = None
        """Stepped once per engine step while set (its schedule picks which steps it records)."""

    def _step(self) -> None:
        prompts_before = self._stats.prompt_tokens_total
        start = time.perf_counter()
        super()._step()
        if self._device.type == "cuda":
            torch.cuda.synchronize()
        joined = self._stats.prompt_tokens_total != prompts_before
        self.step_times.append((start, time.perf_counter() - start, joined))
        if self.profiler is not None:
            self.profiler.step()


def build_model(name: str, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    config = Qwen3Config(**MODELS[name], max_position_embeddings=4096, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype).eval()


def build_requests(args: argparse.Namespace, vocab: int, tag: str) -> list[GenerationRequest]:
    rng = random.Random(0)
    requests = []
    for i in range(args.requests):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        max_tokens = rng.randint(args.completion_min, args.completion_max)
        params = SamplingParams(max_tokens=max_tokens, logprobs=8, seed=i, ignore_eos=True)
        requests.append(GenerationRequest(f"{tag}{i}", prompt, params))
    return requests


def run(engine: TimedEngine, requests: list[GenerationRequest]) -> dict[str, float]:
    clocks = cpu_clocks({"engine": engine.thread})
    cpu, start = cpu_times(clocks), time.perf_counter()
    results = [future.result() for future in [engine.submit(request) for request in requests]]
    end, cpu = time.perf_counter(), cpu_times(clocks, since=cpu)
    return summarize(engine, len(requests), sum(len(result.token_ids) for result in results), start, end, cpu)


def cpu_clocks(threads: dict[str, threading.Thread]) -> dict[str, int]:
    """CPU-time clocks: this process's ("server") and each named thread's."""
    clocks = {name: time.pthread_getcpuclockid(thread.ident or 0) for name, thread in threads.items()}
    return {"server": time.CLOCK_PROCESS_CPUTIME_ID, **clocks}


def cpu_times(clocks: dict[str, int], since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds on each clock (less ``since``)."""
    return {name: time.clock_gettime(clock) - (since or {}).get(name, 0.0) for name, clock in clocks.items()}


def summarize(
    engine: TimedEngine, requests: int, tokens: int, start: float, end: float, cpu: dict[str, float]
) -> dict[str, float]:
    """Tokens/s between ``start`` and ``end``, the engine's decoding steps (those no row joined in) since
    ``start``, and CPU time per token by clock (steadier than wall time on a shared CPU; the split between the
    engine thread and the HTTP event loop's)."""
    steps = [(seconds, joined) for began, seconds, joined in engine.step_times if began >= start]
    decode = [seconds for seconds, joined in steps if not joined]
    return {
        "requests": requests,
        "generated_tokens": tokens,
        "wall_s": end - start,
        "tokens_per_s": tokens / (end - start),
        "steps": len(steps),
        "join_steps": len(steps) - len(decode),
        "decode_step_ms_median": 1000 * statistics.median(decode) if decode else float("nan"),
        "decode_step_ms_mean": 1000 * statistics.fmean(decode) if decode else float("nan"),
        **{f"{name}_cpu_ms_per_token": 1000 * seconds / tokens for name, seconds in cpu.items()},
    }


def send_requests(connection: Connection, url: str, requests: list[GenerationRequest]) -> None:
    """In the client process: post every request at once as the rollout worker does and send back (tokens, start,
    end) on ``time.perf_counter``'s clock (CLOCK_MONOTONIC, the server process's too). A round of one-token
    requests first opens the client's connections, as a long-lived rollout worker has them; then it says "warm"
    and waits for the word to go."""

    async def send() -> tuple[int, float, float]:
        async with GenerationClient(url, model="builtin", timeout_s=3600) as client:
            one_token = SamplingParams(max_tokens=1)
            await asyncio.gather(*[client.complete(request.prompt_ids[:1], one_token) for request in requests])
            connection.send("warm")
            connection.recv()
            start = time.perf_counter()
            completions = [client.complete(request.prompt_ids, request.params) for request in requests]
            tokens = sum(len(completion.token_ids) for completion in await asyncio.gather(*completions))
            return tokens, start, time.perf_counter()

    connection.send(asyncio.run(send()))


def run_http(engine: TimedEngine, requests: list[GenerationRequest], vocab: int) -> dict[str, float]:
    """``requests`` through the HTTP app served from a thread of this process, posted from a client process."""
    server = BuiltinServer(engine, word_tokenizer(vocab), served_model_name="builtin", model_path="random",
                           max_logprobs=20)  # fmt: skip
    port = free_port()
    config = uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning", access_log=False)
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, name="uvicorn", daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    context = multiprocessing.get_context("spawn")
    connection, theirs = context.Pipe()
    client = context.Process(target=send_requests, args=(theirs, f"http://127.0.0.1:{port}", requests))
    client.start()
    connection.recv()  # "warm"
    clocks = cpu_clocks({"engine": engine.thread, "event_loop": thread})
    cpu = cpu_times(clocks)
    connection.send("go")
    tokens, start, end = connection.recv()
    cpu = cpu_times(clocks, since=cpu)
    client.join()
    http.should_exit = True
    thread.join()
    result = summarize(engine, len(requests), tokens, start, end, cpu)
    return {f"http_{key}": value for key, value in result.items()}


def time_cache_step(
    layer_type: type, config: Qwen3Config, rows: int, width: int, device: str, dtype: torch.dtype, steps: int = 20
) -> float:
    """Milliseconds of one decoding step's cache updates over every layer, starting from ``width`` columns."""
    shape = (rows, config.num_key_value_heads, 1, config.head_dim)
    token = torch.randn(shape, device=device).to(dtype)
    layers = [layer_type() for _ in range(config.num_hidden_layers)]
    for layer in layers:
        layer.update(token.expand(-1, -1, width, -1).contiguous(), token.expand(-1, -1, width, -1).contiguous())
    start = time.perf_counter()
    for _ in range(steps):
        for layer in layers:
            layer.update(token, token)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / steps


def start_profiler(steps: int, skip: int, device: str) -> torch.profiler.profile | None:
    """A started profiler that records ``steps`` engine steps after the first ``skip`` (past the joining prefill)."""
    if steps <= 0:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=skip, warmup=2, active=steps, repeat=1)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule, with_stack=False)
    profiler.start()
    return profiler


def print_profile(profiler: torch.profiler.profile, device: str) -> None:
    """Operators by device time (cuda) or host time, and the recorded steps' host time against device time."""
    key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    table = profiler.key_averages().table(sort_by=key, row_limit=30)
    print(table)
    if out := os.environ.get("OUT"):
        Path(out, "builtin_server_profile.txt").write_text(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on cuda")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-min", type=int, default=128)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--completion-min", type=int, default=128)
    parser.add_argument("--completion-max", type=int, default=512)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the operator table of N decoding steps from the middle of the run")  # fmt: skip
    parser.add_argument("--http", action="store_true",
                        help="then time the same requests through the HTTP app (/v1/completions)")  # fmt: skip
    parser.add_argument("--switch-interval", type=float, default=None, metavar="MS",
                        help="override the server's sys.setswitchinterval (0.5 ms; Python's default: 5 ms): how "
                             "long the HTTP event loop may wait for the GIL the engine thread holds")  # fmt: skip
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = build_model(args.model, args.device, dtype)
    max_len = args.prompt_max + args.completion_max
    config = EngineConfig(max_model_len=max_len, max_num_seqs=max(args.requests, 1),
                          kv_cache_tokens=max(args.requests, 1) * max_len, eos_token_ids=frozenset({0}))  # fmt: skip
    engine = TimedEngine(model, config)
    prepare_serving_process()  # as asyncrl.engine's main does before serving
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1000)
    engine.start()
    try:
        warmup = argparse.Namespace(**{**vars(args), "requests": 4, "completion_min": 8, "completion_max": 8})
        run(engine, build_requests(warmup, model.config.vocab_size, "warmup-"))
        engine.profiler = start_profiler(args.profile, args.completion_min // 2, args.device)
        result = run(engine, build_requests(args, model.config.vocab_size, "r"))
    finally:
        engine.stop()
    if engine.profiler is not None:
        engine.profiler.stop()
        print_profile(engine.profiler, args.device)
    if args.http:
        requests = build_requests(args, model.config.vocab_size, "r")
        result |= run_http(TimedEngine(model, config), requests, model.config.vocab_size)
    width = (args.prompt_min + args.prompt_max + args.completion_min + args.completion_max) // 2
    for name, layer_type in (("dynamic", DynamicLayer), ("slack", SlackLayer)):
        result[f"cache_step_ms_{name}"] = time_cache_step(layer_type, model.config, args.requests, width,
                                                          args.device, dtype)  # fmt: skip
    result = {"device": args.device, "model": args.model, "dtype": str(dtype).removeprefix("torch."), **result}
    width = max(len(key) for key in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value:.2f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if out := os.environ.get("OUT"):
        Path(out, "builtin_server.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
