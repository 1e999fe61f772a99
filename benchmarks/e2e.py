"""End-to-end speed with the real CLI on one GPU: does overlapping generation and training pay? (issue 11)

    python benchmarks/e2e.py                                   # H200: vLLM and the trainer share the GPU (ipc sync)
    python benchmarks/e2e.py --backend builtin --tiny --steps 3   # CPU rehearsal of the same phases

FP8 rollouts (issue 36): ``--quantization fp8`` then starts a second server with ``server.quantization=fp8`` (vLLM
quantizes the bf16 weights as it loads them, and again at each sync, which goes through vLLM's ipc engine) and
measures it the same way; a last table compares it with the bf16 server: generated tokens/s (alone and in each
run), samples/s, ``sampling/sampling_logp_difference`` and sync seconds, against the goal (>= 1.3x tokens/s, <= 2x
logp difference). A run whose syncs fail is a failed row; the bf16 server's syncs load in place (asyncrl's worker
extension), the fp8 server's through vLLM's engine, so the sync seconds compare the paths each must take.

Both servers in one device call do not fit its 600 s at the 0.6B shape (session 24: the bf16 server healthy after
162 s cold, its 10-step run done 62 s after its first step; the fp8 server healthy after 149 s; the call cut in the
fp8 run). ``--baseline`` takes the bf16 server's figures from an earlier call instead (its e2e.json or
partial_vllm.json; session 24's, at the 0.6B shape, commit b0ff182, are in benchmarks/results/e2e/), so a call
starts one server (vLLM 0.33's kit sourced first, tools/vllm-kit/README.md):

    python benchmarks/e2e.py --quantization fp8 --baseline benchmarks/results/e2e/vllm-0.6b-staleness2.json \
        --staleness 2 --steps 10 --no-flat --profile= --run-timeout 200 --standalone-requests 1024
    python benchmarks/e2e.py --shape 3.5-2b --assets /tmp/a2b --prewarm --run-timeout 540   # see below
    python benchmarks/e2e.py --shape 3.5-2b --assets /tmp/a2b --staleness 2 --steps 6 --no-flat --profile= \
        --run-timeout 300 --standalone-requests 1024 --out /tmp/e2e-2b    # then, in the next call on the machine:
    python benchmarks/e2e.py --shape 3.5-2b --assets /tmp/a2b --quantization fp8 --baseline /tmp/e2e-2b/e2e.json \
        --staleness 2 --steps 6 --no-flat --profile= --run-timeout 300 --standalone-requests 1024

Each server's log stays on the machine: the result keeps its distinct warnings with their counts, and the table
counts the layer loads the syncs left out (vLLM's layerwise reload, which the fp8 server's syncs take, logs
"Failed to load weights" for each layer a sync sent nothing to).

``--table FILE --baseline FILE`` prints a quantized call's table again against a bf16 server measured in another
call (session 27: the same code's, in place of session 24's).

At the 2B shape the trainer's cold start (its warm-up compiles fla's Triton kernels and the layers: 301 s in session
26) and vLLM's cold boot (253 s) do not fit one call either: ``--prewarm`` runs the trainer's start-up alone in an
earlier call (against a stand-in server), filling the compile caches the machine keeps between calls.

A server's standalone rates: all tokens over the wall time, which with 256 requests at 256 in flight waits on the
longest ones' last, nearly empty steps (session 26's 1.17x at 2B), and, with more requests than the concurrency,
the saturated rate (the server's generation counter while the concurrency stayed full, as in a run); the bf16
figures from session 24 have only the first.

One server is started (vLLM, or the built-in one) and every variant attaches to it with `asyncrl train
server.launch=false`, so each variant pays the trainer's start-up only. The model is Qwen3-0.6B-shaped (``--shape
3.5-2b``: Qwen3.5-2B's text model) with random weights and a locally built word-level tokenizer; each rollout's
length is drawn from a log-normal tail (`min_tokens = max_tokens`, through the rollout loop's `sampling_params`
hook) so timing resembles reasoning RL whatever the random model samples. Reward: closeness of the length to the
median (cheap, verifiable, varies within a group). Prints one table; writes e2e.json under --out (and $OUT when
set).

The mid-run recompile (issue 36, item 3): each run also prints the steps after the first that took over twice their
median, and every line CompileWatch logged (``torch.compile: S s compiling ... during row N``) in its launch.log:

    python benchmarks/e2e.py --staleness 2 --steps 12 --no-flat --profile= --run-timeout 300
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.rollout.loop import AsyncRolloutLoop  # noqa: E402

SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                 tie_word_embeddings=True),
    # Qwen3.5-2B's text model (three gated-DeltaNet layers per attention layer), served text-only
    "3.5-2b": dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                   linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, layer_types=None,
                   max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True),
}  # fmt: skip
# (prompt words lo, hi), median completion tokens, sigma of log length, max completion tokens, token budget
GROUP_SIZE = 8  # rollouts per prompt
WORKLOAD = {"0.6b": ((128, 512), 128, 0.9, 512, 16384), "tiny": ((8, 24), 12, 0.6, 48, 512)}
WORKLOAD["3.5-2b"] = WORKLOAD["0.6b"]


class LengthControlledLoop(AsyncRolloutLoop):
    """Each turn's length is drawn from a log-normal (seeded by the request seed), so a random model's rollouts
    have the long tail of reasoning RL: ``rollout.options`` = {median_tokens, sigma}."""

    def sampling_params(self, prompt_ids: list[int]):  # type: ignore[no-untyped-def]
        params = super().sampling_params(prompt_ids)
        options = self.config.rollout.options
        rng = random.Random(params.seed)
        length = int(
            min(params.max_tokens, max(8, rng.lognormvariate(math.log(options["median_tokens"]), options["sigma"])))
        )
        return dataclasses.replace(params, max_tokens=length, min_tokens=length)


# ---- the model, tokenizer and prompts the run builds ----------------------------------------------------------


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with one word per id (id 0 ends a text, 1 is unknown, "wN" is id N): random-weight
    models of any vocabulary get text the servers can decode, with nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")  # fmt: skip


def build_assets(out: Path, shape: str, num_prompts: int = 512) -> tuple[Path, Path]:
    """A random-weight model + word-level tokenizer (one word per id) and a jsonl of random prompts."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir, data = out / "model", out / "prompts.jsonl"
    if (model_dir / "config.json").exists() and data.exists():
        return model_dir, data
    cfg = SHAPES[shape]
    tokenizer = word_tokenizer(cfg["vocab_size"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    torch.manual_seed(0)
    if "linear_num_key_heads" in cfg:
        from asyncrl.assets.model_families import build_model, hybrid_text_config, save_checkpoint

        save_checkpoint(build_model(hybrid_text_config(tokenizer, **cfg), tokenizer), tokenizer, model_dir)
    else:
        config = Qwen3Config(**cfg, eos_token_id=0, pad_token_id=0, bos_token_id=None)
        Qwen3ForCausalLM(config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    (lo, hi), *_ = WORKLOAD[shape]
    rng = random.Random(0)
    with data.open("w") as f:
        for _ in range(num_prompts):
            words = " ".join(f"w{rng.randrange(2, cfg['vocab_size'])}" for _ in range(rng.randint(lo, hi)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": words}]}) + "\n")
    return model_dir, data


def base_overrides(args: argparse.Namespace, model_dir: Path, data: Path) -> list[str]:
    _, median, sigma, max_len, budget = WORKLOAD[args.shape]
    server = (["server.backend=vllm", "server.dtype=bfloat16", f"server.gpu_memory_utilization={args.gpu_memory}",
               f"server.extra_args=[{'--enforce-eager' if args.eager else ''}]"]
              if args.backend == "vllm" else
              ["server.backend=builtin", f"server.dtype={'bfloat16' if args.device == 'cuda' else 'float32'}",
               f"server.device={args.device}", f"server.max_num_seqs={args.concurrency}"])  # fmt: skip
    return [
        f"model.name_or_path={model_dir}", f"data.path={data}", "data.eval_path=null", "reward=length",
        f"reward_funcs=[{{name:length,target:{median},scale:0.01}}]",
        # GRPO's clipped loss needs only the sampled token's log-probability: top-k sets would make vLLM 0.26's one
        # API process, not the GPU, the bound on generation
        "loss=clipped", f"sampling.num_generations={GROUP_SIZE}", f"sampling.max_completion_length={max_len}",
        "sampling.num_sampler_logprobs=0",
        "rollout.loop_cls=benchmarks.e2e:LengthControlledLoop",
        f"++rollout.options={{median_tokens:{median},sigma:{sigma}}}",
        f"staleness.max_concurrent_rollouts={args.concurrency}", "trainer.learning_rate=1e-6",
        "trainer.save_strategy=no", f"trainer.gradient_checkpointing={args.device == 'cuda'}",
        f"packing.token_budget={budget}", "logging.console=plain", f"server.port={args.port}", *server,
        # the launched server loads weights only from here, where the attached runs write them
        f"server.weights_dir={args.work / 'weights'}",
        # 4 rows a step: a 1-row step waits on its longest rollout and measures the tail, not the pipeline
        *([] if args.tiny else ["trainer.gradient_accumulation_steps=4"]), *cpu_threads(args), *args.extra,
    ]  # fmt: skip


def cpu_threads(args: argparse.Namespace) -> list[str]:
    """On the CPU the attached server shares this machine, which an attached trainer cannot know: leave it its
    core (server.cpu_threads=1). At 20 steps, staleness 0/1/2: 103.9/110.0/130.2 samples/s at the trainer's
    2 threads on 2 cores, 112.8/133.2/139.3 at 1."""
    if args.device != "cpu":
        return []
    from asyncrl.trainer.model import available_cores

    return [f"trainer.cpu_threads={max(1, available_cores() - 1)}"]


# ---- phases -----------------------------------------------------------------------------------------------------


def standalone_rates(base_url: str, name: str, args: argparse.Namespace, requests: int) -> tuple[float, float | None]:
    """The server alone: `requests` rollouts of the workload's length tail at the run's concurrency, in groups of
    GROUP_SIZE sharing a prompt, as GRPO asks (a server with prefix caching prefills each prompt once).

    Two rates. All tokens over the wall time: with few more requests than the concurrency, that waits on the
    longest requests' last, nearly empty decode steps (session 26: 256 requests, the longest 512 tokens). And the
    saturated rate, the server's own generation counter from the first completion to the last request's admission:
    all that time `concurrency` requests were in flight, refilled as each ended, as the rollout loop keeps them
    (None unless requests exceed the concurrency)."""
    from asyncrl.client import ControlClient, GenerationClient, SamplingParams

    (lo, hi), median, sigma, _, _ = WORKLOAD[args.shape]
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(1)
    jobs = []
    for i in range(requests):
        if i % GROUP_SIZE == 0:
            prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))]
        length = int(min(WORKLOAD[args.shape][3], max(8, rng.lognormvariate(math.log(median), sigma))))
        jobs.append((prompt, SamplingParams(max_tokens=length, min_tokens=length, logprobs=0, seed=i)))

    async def run(control: ControlClient) -> tuple[float, float | None]:
        gate, admitted, marks = asyncio.Semaphore(args.concurrency), 0, []
        window = {args.concurrency + 1, requests} if requests > args.concurrency else set()

        async def mark() -> None:  # a server without the counter gets no saturated rate, not a failed call
            counter = (await asyncio.to_thread(control.metrics)).get("vllm:generation_tokens_total")
            if counter is not None:
                marks.append((time.perf_counter(), counter))

        async with GenerationClient(base_url, name, timeout_s=600) as client:

            async def one(prompt: list[int], params: SamplingParams) -> int:
                nonlocal admitted
                async with gate:
                    admitted += 1
                    if admitted in window:
                        await mark()
                    return len((await client.complete(prompt, params)).token_ids)

            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(p, s) for p, s in jobs)))
            total = tokens / (time.perf_counter() - started)
        if len(marks) < 2 or marks[1][0] <= marks[0][0]:
            return total, None
        (t0, c0), (t1, c1) = marks
        return total, (c1 - c0) / (t1 - t0)

    with ControlClient(base_url) as control:
        return asyncio.run(run(control))


def train(args: argparse.Namespace, base: list[str], base_url: str, name: str, extra: list[str]) -> dict[str, Any]:
    """One `asyncrl train` attached to the running server; its metrics rows and timeline summary."""
    run_dir = args.work / "runs" / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    argv = [sys.executable, "-m", "asyncrl", "train", *base, "server.launch=false", f"server.base_url={base_url}",
            f"trainer.max_steps={args.steps}", f"hydra.run.dir={run_dir}", *extra]  # fmt: skip
    print("$ asyncrl train ... " + " ".join(extra), flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        print(f"[{name}] stopped after --run-timeout {args.run_timeout:.0f} s", flush=True)
        return {"name": name, "failed": "timeout", "steps_done": keep_log(args, run_dir, name)}
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-5000:], flush=True)
        return {"name": name, "failed": proc.returncode, "steps_done": keep_log(args, run_dir, name)}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timeline = json.loads((run_dir / "timeline.json").read_text())["summary"]
    compiles = compile_lines((run_dir / "launch.log").read_text(errors="replace"))
    return {"name": name, "cli_wall_s": wall, "rows": rows, "timeline": timeline, "compiles": compiles}


def keep_log(args: argparse.Namespace, run_dir: Path, name: str) -> int:
    """A failed or cut run's launch.log, as launch_NAME.log under --out (the work directory is not returned from a
    device call): where its time went (model load, warm-up, compiles, steps). Returns the steps it logged."""
    log = run_dir / "launch.log"
    if log.exists():
        (args.out / f"launch_{name}.log").write_text(log.read_text(errors="replace"))
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def compile_lines(launch_log: str) -> list[str]:
    """What CompileWatch logged (trainer/forward.py: ``torch.compile: S s compiling (...) during row N``), warm-up
    and steps alike: a compile past the warm-up is what a slow step mid-run would be (issue 36, item 3)."""
    return [line.partition("torch.compile: ")[2] for line in launch_log.splitlines() if "torch.compile: " in line]


def slow_steps(step_s: list[float]) -> list[int]:
    """The steps after the first (1-based) that took over twice the median of those steps: the mid-run stalls."""
    later = step_s[1:]
    if not later:
        return []
    median = statistics.median(later)
    return [i + 2 for i, s in enumerate(later) if s > 2 * median]


def summarise(run: dict[str, Any], profiled: bool = False) -> dict[str, Any]:
    """The table's quantities from one run's metrics rows (a profiled last step is left out of the timing)."""
    rows = [r.get("metrics", r) for r in run["rows"]]

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]

    def mean(key: str, skip: int = 0) -> float:
        values = series(key)[skip:]
        return sum(values) / len(values) if values else float("nan")

    times = series("time_s")[: -1 if profiled else None]
    steady = (times[-1] - times[1]) / (len(times) - 2) if len(times) > 2 else float("nan")
    # the first step compiles the layers: speed is read from the steps after it
    trained = series("batch/trained_tokens_per_step")[1:]
    fwd_bwd = series("perf/fwd_bwd_s")[1:]
    dropped = sum(series("sample/dropped_stale_count"))
    used = sum(series("batch/samples_per_step"))
    mfu = series("perf/fwd_bwd_mfu")[1:]  # logged by the trainer where the GPU's peak is known (trainer/flops.py)
    mfu_weighted = sum(m * s for m, s in zip(mfu, fwd_bwd, strict=False)) / max(sum(fwd_bwd), 1e-9) if mfu else math.nan
    return {
        "name": run["name"], "steps": len(rows), "time_to_last_step_s": times[-1], "steady_step_s": steady,
        "sync_s": mean("perf/weight_sync_s", 1), "sync_pause_s": mean("perf/weight_sync_pause_s", 1),
        "sync_transfer_s": mean("perf/weight_sync_transfer_s", 1),
        "sync_max_s": max(series("perf/weight_sync_s")[1:] or [math.nan]),
        "gen_paused_s": mean("perf/generation_paused_s", 1),
        "preempted_per_step": mean("rollout/vllm_preemption_count", 1),
        "gen_tokens_per_s": mean("rollout/generated_tokens_per_s", 1), "concurrency": mean("rollout/concurrency", 1),
        "logp_diff": mean("sampling/sampling_logp_difference/mean", 1),
        "samples_per_step": mean("batch/samples_per_step", 1), "backpressure_s": mean("rollout/backpressure_s", 1),
        "trained_tokens_per_s": sum(trained) / max(sum(fwd_bwd), 1e-9), "mfu": mfu_weighted,
        "packing_ratio": mean("batch/packing_ratio"),
        "staleness_mean": mean("sample/staleness_mean"), "staleness_max": max(series("sample/staleness_max") or [0]),
        "dropped_stale_frac": dropped / max(dropped + used, 1), "overlap_frac": run["timeline"]["overlap_frac"],
        "phases_s": {k.split("/")[-1]: mean(k, 1) for k in ("perf/step_s", "perf/rollout_wait_s", "perf/fwd_bwd_s",
                                                              "perf/optimizer_s", "perf/weight_sync_s")},
        "cap": series("rollout/concurrency_cap"), "kv_usage": series("rollout/vllm_kv_cache_usage_frac"),
        "step_s": series("perf/step_s"), "slow_steps": slow_steps(series("perf/step_s")),
        "compiles": run.get("compiles", []),
        "rows": rows,
    }  # fmt: skip


# ---- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "builtin"], default="vllm")
    parser.add_argument("--tiny", action="store_true", help="tiny model and workload (CPU rehearsal)")
    parser.add_argument("--shape", choices=["0.6b", "3.5-2b"], default="0.6b", help="the model's shape (not --tiny)")
    parser.add_argument("--quantization", default=None, help="then serve with server.quantization=Q (e.g. fp8) and "
                        "measure it the same way; the table compares it with the first server")  # fmt: skip
    parser.add_argument("--baseline", type=Path, default=None, help="with --quantization or --table: the 16-bit "
                        "server's figures from an earlier e2e.json or partial_vllm.json, not served again")  # fmt: skip
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", default="0,1,2,4", help="max_staleness values; 0 = synchronous mode")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--gpu-memory", type=float, default=0.3, help="vLLM --gpu-memory-utilization")
    parser.add_argument("--standalone-requests", type=int, default=512)
    parser.add_argument("--no-flat", action="store_true", help="skip the flat-packing run")
    parser.add_argument("--in-flight-too", action="store_true", help="each --staleness run again with "
                        "staleness.in_flight_weight_updates=true, against the same server (issue 57)")  # fmt: skip
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    parser.add_argument("--builtin-too", action="store_true", help="also time the built-in server on the GPU")
    parser.add_argument("--eager", action="store_true", help="vLLM --enforce-eager (no CUDA graphs, faster start)")
    parser.add_argument("--profile", default="staleness2", help="the run whose last step is profiled ('' = none)")
    parser.add_argument("--table", type=Path, nargs="+", help="print one table from earlier e2e.json files; no run")
    parser.add_argument("--assets", type=Path, default=None, help="where the model and prompts are built (reused)")
    parser.add_argument("--serve", action="store_true", help="only run the workload's server in the foreground")
    parser.add_argument("--prewarm", action="store_true", help="only fill the trainer's compile caches for the "
                        "shape (a trainer against a stand-in, stopped after its warm-up); no server")  # fmt: skip
    parser.add_argument("--server-url", default=None, help="attach to a server started with --serve")
    parser.add_argument("--port", type=int, default=8000, help="the server's port (the built-in one's is +1)")
    parser.add_argument("--run-timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.table:
        print_table(table_result(args.table, args.baseline))
        return
    if args.quantization and (args.server_url or args.backend != "vllm"):
        parser.error("--quantization starts a second vLLM server after the first: --backend vllm, no --server-url")
    if args.baseline and not args.quantization:
        parser.error("--baseline stands in for the 16-bit server beside --quantization's: give --quantization too")
    import torch

    args.shape = "tiny" if args.tiny else args.shape
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="e2e-"))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="e2e-work-"))  # runs and servers; only results go to --out
    (args.work / "weights").mkdir()
    if args.server_url:
        wait_healthy(args.server_url)  # its --serve process builds the assets first
    started = time.perf_counter()
    model_dir, data = build_assets(args.assets or args.work, args.shape)
    print(f"[build] {args.shape} model + tokenizer + prompts in {time.perf_counter() - started:.0f} s", flush=True)
    base = base_overrides(args, model_dir, data)
    if args.serve:
        os.execv(sys.executable, [sys.executable, "-m", "asyncrl", "serve", *base,
                                  f"trainer.output_dir={args.work / 'serve'}"])  # fmt: skip
    if args.prewarm:
        prewarm(args, base)
        return
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.baseline:
        result["server"] = baseline_server(args.baseline)
    else:
        result["server"] = serve_and_measure(args, base, args.backend, train_runs=bool(args.staleness),
                                             url=args.server_url)  # fmt: skip
    if args.quantization:
        result["quantized_server"] = serve_and_measure(args, [*base, f"server.quantization={args.quantization}"],
                                                       args.backend, train_runs=bool(args.staleness),
                                                       label=args.quantization)  # fmt: skip
    if args.builtin_too and args.backend == "vllm":
        args.backend = "builtin"
        result["builtin_server"] = serve_and_measure(args, base_overrides(args, model_dir, data), "builtin",
                                                     train_runs=False, port=args.port + 1)  # fmt: skip
    (args.out / "e2e.json").write_text(json.dumps(result, indent=1))
    print_table(result)


def prewarm(args: argparse.Namespace, base: list[str]) -> None:
    """The trainer's start-up for this shape, against a stand-in that answers every request with ``{}``: the model
    loads, the warm-up step compiles the layers (and fla's Triton kernels, at the hybrid shape), then the first
    request that needs a real server ends the run. At the 2B shape that cold compile (301 s) and vLLM's cold
    boot do not fit one device call; filled in an earlier call, the caches on the machine make the run's start-up
    warm (say so beside its figures)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class StandIn(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def log_message(self, *_: Any) -> None:
            return None

    stand_in = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    Thread(target=stand_in.serve_forever, daemon=True).start()
    try:
        train(args, base, f"http://127.0.0.1:{stand_in.server_port}", "prewarm", [])
    finally:
        stand_in.shutdown()
    log = (args.work / "runs" / "prewarm" / "launch.log").read_text(errors="replace")
    warmed = [line for line in log.splitlines() if "warm-up step (" in line]
    compiled = sum("torch.compile" in line for line in log.splitlines())  # CompileWatch's compiles and recompiles
    print(f"[prewarm] {warmed[-1] if warmed else 'no warm-up ran (trainer.warm_up needs CUDA)'}; {compiled} "
          "compile lines in its launch.log")  # fmt: skip


def table_result(paths: list[Path], baseline: Path | None) -> dict[str, Any]:
    """``--table``'s result: earlier e2e.json files merged; with ``--baseline``, a quantized call's 16-bit server
    replaced by one measured in another call (session 27: the same code's bf16 server, where the fp8 call had been
    compared with session 24's)."""
    result = merge([json.loads(path.read_text()) for path in paths])
    if baseline is not None:
        result["server"] = baseline_server(baseline)
    return result


def baseline_server(path: Path) -> dict[str, Any]:
    """The 16-bit server's figures from an earlier call on the same machine kind: its e2e.json's ``server``, or a
    partial_LABEL.json (a call cut in its quantized server's runs still wrote the first server's)."""
    earlier = json.loads(path.read_text())
    return earlier["server"] if "server" in earlier else earlier


def wait_healthy(url: str, timeout_s: float = 900.0) -> None:
    from asyncrl.serving.handle import AttachedServer

    server, deadline = AttachedServer(url, timeout_s), time.monotonic() + timeout_s
    while not server.is_alive():
        if time.monotonic() > deadline:
            raise SystemExit(f"no healthy server at {url} after {timeout_s:.0f} s")
        time.sleep(2.0)


def serve_and_measure(args: argparse.Namespace, base: list[str], backend: str, train_runs: bool = True,
                      url: str | None = None, port: int | None = None, label: str | None = None) -> dict:  # fmt: skip
    """Start the server (or attach to ``url``), time it alone, then run the training variants against it.
    ``label``: a second server of the same backend (its directories and runs are named by it)."""
    from asyncrl.config.compose import compose
    from asyncrl.launch import start_server
    from asyncrl.plan.assemble import plan_run
    from asyncrl.serving.command import served_model_name

    label = label or backend
    server_dir = args.work / f"server-{label}"
    where = ["server.launch=false", f"server.base_url={url}"] if url else [f"server.port={port or args.port}"]
    plan = plan_run(compose([*base, *where, f"trainer.output_dir={server_dir}"]), server_dir)
    config = plan.config
    out: dict[str, Any] = {"backend": backend, "label": label}
    server_dir.mkdir(parents=True, exist_ok=True)

    def save_partial() -> None:  # what a later time-out of the call keeps
        (args.out / f"partial_{label}.json").write_text(json.dumps(out, indent=1))

    started = time.perf_counter()
    try:
        with start_server(plan, server_dir) as server:
            out["startup_s"] = time.perf_counter() - started
            name = served_model_name(config)
            print(f"[{label}] healthy after {out['startup_s']:.0f} s at {server.base_url}", flush=True)
            standalone_rates(server.base_url, name, args, requests=min(64, args.standalone_requests))  # warm-up
            rates = standalone_rates(server.base_url, name, args, args.standalone_requests)
            out["standalone_tokens_per_s"], out["saturated_tokens_per_s"] = rates
            saturated = f", {rates[1]:,.0f} saturated" if rates[1] is not None else ""
            print(f"[{label}] standalone: {rates[0]:,.0f} generated tokens/s{saturated}", flush=True)
            save_partial()
            if not train_runs:
                return out
            out["runs"] = []
            for name_, extra in run_variants(args, "" if label == backend else f"{label}_"):
                profiled = name_ == args.profile
                run = train(args, base, server.base_url, name_,
                            [*extra, *([f"logging.profile_steps=[{args.steps}]"] if profiled else [])])  # fmt: skip
                if "failed" in run:
                    out["runs"].append(run)
                    continue
                if profiled:
                    table = args.work / "runs" / name_ / "profile" / f"step_{args.steps}.txt"
                    (args.out / f"profile_{name_}.txt").write_text(table.read_text())
                summary = summarise(run, profiled)
                out["runs"].append(summary)
                save_partial()
                scalars = {k: v for k, v in summary.items() if not isinstance(v, list | dict)}
                print(f"[{name_}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in scalars.items()), flush=True)
    finally:  # the server's log stays on the device machine: its warnings come back in the result
        out["server_warnings"] = server_warnings(sorted((server_dir / "logs").glob("server*.log")))
        save_partial()
    return out


def run_variants(args: argparse.Namespace, prefix: str) -> list[tuple[str, list[str]]]:
    """The training runs against one server, named and with their overrides: one per --staleness value, then the
    flat-packing one."""
    variants = [(f"{prefix}staleness{k}", [f"staleness.max_staleness={k}"]) for k in args.staleness.split(",")]
    if args.in_flight_too:  # the plain runs first, then their in-flight twins
        variants += [(f"{prefix}inflight_{name}", [*extra, "staleness.in_flight_weight_updates=true"])
                     for name, extra in list(variants)]  # fmt: skip
    flat = ["staleness.max_staleness=2", "packing=flat", f"packing.token_budget={WORKLOAD[args.shape][4]}"]
    return variants + ([] if args.no_flat else [(f"{prefix}flat_staleness2", flat)])


def server_warnings(logs: list[Path], limit: int = 50) -> dict[str, int]:
    """Each distinct warning or error of the server's logs, without its time stamp, and how often it came (the first
    ``limit``): vLLM's layerwise reload, which a quantized server's syncs take, says "<layer class>: Failed to load
    weights" for each layer a sync sent nothing to, which keeps its old weights (rightly for a frozen layer the
    trainer never sends, such as a vision tower; the shapes here have none)."""
    found: dict[str, int] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            level = next((level for level in ("ERROR", "WARNING") if level in line), None)
            if level is not None:
                message = f"{level} {line.partition('] ')[2] or line}".strip()
                found[message] = found.get(message, 0) + 1
    return dict(list(found.items())[:limit])


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several invocations (each started its own server): runs joined, standalone rates kept."""
    merged = {"server": {**results[0]["server"], "runs": []}}
    for result in results:
        merged["server"]["runs"] += result["server"].get("runs", [])
        for key in ("builtin_server", "quantized_server"):
            if key in result:
                merged[key] = result[key]
    rates = [r["server"]["standalone_tokens_per_s"] for r in results]
    merged["server"]["standalone_tokens_per_s"] = sum(rates) / len(rates)
    merged["server"]["standalone_each"] = rates
    return merged


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def samples_per_s(run: dict[str, Any]) -> float:
    return run["samples_per_step"] / run["steady_step_s"]


GOAL_TOKENS_X, GOAL_LOGP_X = 1.3, 2.0
"""Issue 36's goal for a quantized server against the bf16 one: generated tokens/s at least 1.3x, with the
sampler-trainer logp difference at most 2x."""


def quantized_rows(plain: dict[str, Any], quantized: dict[str, Any]) -> list[dict[str, Any]]:
    """The quantized server against the bf16 one: the servers alone, then each training run of the quantized one
    against the bf16 run of its name: (bf16, quantized) pairs of generated tokens/s, samples/s, logp difference and
    sync seconds, and whether the goal is met. A failed quantized run stays a row: a sync that did not land fails."""
    rows: list[dict[str, Any]] = [
        {"name": "server alone", "tokens": (plain["standalone_tokens_per_s"], quantized["standalone_tokens_per_s"])}
    ]
    if plain.get("saturated_tokens_per_s") and quantized.get("saturated_tokens_per_s"):  # older results lack it
        rows.append({"name": "server alone, saturated",
                     "tokens": (plain["saturated_tokens_per_s"], quantized["saturated_tokens_per_s"])})  # fmt: skip
    bf16 = {r["name"]: r for r in plain.get("runs", []) if "failed" not in r}
    for run in quantized.get("runs", []):
        name = run["name"].removeprefix(f"{quantized['label']}_")
        if "failed" in run or name not in bf16:
            rows.append({"name": name, "failed": run.get("failed", "no bf16 run of that name")})
            continue
        base = bf16[name]
        row = {"name": name, "tokens": (base["gen_tokens_per_s"], run["gen_tokens_per_s"]),
               "samples": (samples_per_s(base), samples_per_s(run)), "logp": (base["logp_diff"], run["logp_diff"]),
               "sync": (base["sync_s"], run["sync_s"])}  # fmt: skip
        row["goal"] = ratio(row["tokens"]) >= GOAL_TOKENS_X and ratio(row["logp"]) <= GOAL_LOGP_X
        rows.append(row)
    return rows


def ratio(pair: tuple[float, float]) -> float:
    """The second of a (bf16, quantized) pair over the first."""
    return pair[1] / pair[0] if pair[0] else math.nan


def print_quantized(rows: list[dict[str, Any]], label: str) -> None:
    print(f"\n{label} against bf16 (goal: >= {GOAL_TOKENS_X}x generated tokens/s, <= {GOAL_LOGP_X}x logp difference)")
    print("| run | generated tok/s | samples/s | logp difference mean | sync s | goal met |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "failed" in row:
            print(f"| {row['name']} | failed: {row['failed']} | | | | no |")
            continue
        cells = [f"{_figure(row[k][0])} -> {_figure(row[k][1])} ({ratio(row[k]):.2f}x)" if k in row else "-"
                 for k in ("tokens", "samples", "logp", "sync")]  # fmt: skip
        goal = {True: "yes", False: "no"}.get(row.get("goal"), "-")
        print(f"| {row['name']} | " + " | ".join(cells) + f" | {goal} |")


def _figure(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _saturated(server: dict[str, Any]) -> str:
    rate = server.get("saturated_tokens_per_s")  # results before session 26 lack it
    return f"({rate:,.0f} saturated) " if rate else ""


def print_server_warnings(server: dict[str, Any]) -> None:
    """How many distinct warnings the server logged, and how many layers the syncs sent nothing to."""
    if "server_warnings" not in server:  # results before session 27 lack them: nothing to say, not zero
        return
    warnings = server["server_warnings"]
    failed = {line: count for line, count in warnings.items() if "Failed to load weights" in line}
    lines = "".join(f"\n    {count} x {line[:160]}" for line, count in failed.items())
    print(f"{server['label']} server's log: {len(warnings)} distinct warnings or errors; {sum(failed.values())} "
          f"layer loads a sync left out{lines}")  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    servers = [result[key] for key in ("server", "quantized_server") if key in result]
    runs = [r for server in servers for r in server.get("runs", []) if "failed" not in r]
    by_name = {r["name"]: r for r in runs}
    sync = by_name.get("staleness0")
    print(
        "\n| run | steps | samples/step | to last step s | steady s/step | samples/s | speedup vs sync "
        "| sync s mean/max (pause wait/transfer) | gen paused s | preempted/step | gen tok/s (concurrency) "
        "| trained tok/s | MFU | pack ratio | stale mean/max | dropped | overlap | logp diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        speedup = samples_per_s(r) / samples_per_s(sync) if sync else float("nan")  # sync steps can be larger
        print(f"| {r['name']} | {r['steps']} | {r['samples_per_step']:.0f} | {r['time_to_last_step_s']:.1f} | "
              f"{r['steady_step_s']:.2f} | {samples_per_s(r):.1f} | {speedup:.2f}x | "
              f"{r['sync_s']:.3f}/{r.get('sync_max_s', math.nan):.3f} "
              f"({r['sync_pause_s']:.3f}/{r['sync_transfer_s']:.3f}) | "
              f"{r.get('gen_paused_s', math.nan):.3f} | {r.get('preempted_per_step', math.nan):.0f} | "
              f"{r['gen_tokens_per_s']:,.0f} ({r['concurrency']:.0f}) | {r['trained_tokens_per_s']:,.0f} | "
              f"{r['mfu']:.1%} | "
              f"{r['packing_ratio']:.2f} | {r['staleness_mean']:.2f}/{r['staleness_max']:.0f} | "
              f"{r['dropped_stale_frac']:.1%} | {r['overlap_frac']:.2f} | "
              f"{r.get('logp_diff', math.nan):.4f} |")  # fmt: skip
    server = result["server"]
    each = ", ".join(f"{r:,.0f}" for r in server.get("standalone_each", []))
    mean = f"(mean of {each}) " if each else ""
    print(f"\nstandalone {server['backend']} server: {server['standalone_tokens_per_s']:,.0f} generated tokens/s "
          f"{mean}{_saturated(server)}(startup {server['startup_s']:.0f} s)")  # fmt: skip
    if "quantized_server" in result:
        q = result["quantized_server"]
        print(f"standalone {q['label']} server: {q['standalone_tokens_per_s']:,.0f} generated tokens/s "
              f"{_saturated(q)}(startup {q['startup_s']:.0f} s)")  # fmt: skip
        print_quantized(quantized_rows(server, q), q["label"])
    for each in servers:
        print_server_warnings(each)
    if "builtin_server" in result:
        b = result["builtin_server"]
        print(
            f"standalone built-in server on the same GPU: {b['standalone_tokens_per_s']:,.0f} generated tokens/s "
            f"({b['standalone_tokens_per_s'] / server['standalone_tokens_per_s']:.0%} of {server['backend']})"
        )
    print("\nsteps over twice the median of the steps after the first, and what CompileWatch logged:")
    for r in runs:
        print(
            f"  {r['name']}: slow steps {r['slow_steps'] or 'none'} (step s {[round(x, 2) for x in r['step_s']]}); "
            f"{len(r['compiles'])} compiles" + "".join(f"\n    {line[:160]}" for line in r["compiles"])
        )
    print("\nwhere a step's time goes (mean seconds per step after the first):")
    for r in runs:
        print(f"  {r['name']}: " + ", ".join(f"{k}={v:.2f}" for k, v in r["phases_s"].items()))
    for r in runs:
        if r["cap"]:
            print(f"cap trajectory {r['name']}: {[int(c) for c in r['cap']]}; kv usage "
                  f"{[round(k, 2) for k in r['kv_usage']]}")  # fmt: skip


if __name__ == "__main__":
    main()
