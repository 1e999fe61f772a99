"""Padded vs flat vs tree packing: fwd+bwd throughput, peak memory and MFU on GRPO-shaped rows, plus bf16 exactness.

A Qwen3-0.6B-shaped model (or --shape) with random weights built from its config (nothing downloaded), bf16, no gradient
checkpointing. Rows: groups of 8 completions (128-2048 tokens, long-tailed) of one prompt (512-2048 tokens),
planned by the trainer's planner (dp=1) and forwarded by the trainer's `packed_forward` (LM-head log-probs in
chunks of --logit-chunk-tokens); padded batches go through transformers' own SDPA with a padding mask and the
same chunked log-probabilities. Every budget runs padded, flat and tree with eager decoder layers, then flat
and tree again with torch.compile'd layers (the trainer's trainer.compile_layers); exactness of each attention
backend against unpacked SDPA comes last. Imports only torch, transformers and asyncrl.packing/asyncrl.trainer
(no hydra), so it runs on a bare GPU box; with $OUT set, the results also go to $OUT/packing.json:

    python benchmarks/packing.py                       # the H200 table (budgets 16k and 32k), ~4 minutes
    python benchmarks/packing.py --tiny                # a CPU rehearsal of the same code (compiles with aot_eager)
    python benchmarks/packing.py --attention varlen cascade --exact-attention varlen cascade flex
    python benchmarks/packing.py --shape qwen3.5-2b    # a gated-DeltaNet hybrid (fla's kernels when installed)
    python benchmarks/packing.py --shape qwen3.5-2b --no-compile --budgets 16384 --profile --conv reference
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from asyncrl.packing import FlatRow, TreeRow, deltanet, plan_micro_batches
from asyncrl.packing.attention import ATTENTION, cascade_plan
from asyncrl.packing.cascade import ReferenceKernel
from asyncrl.packing.row import PackedRow
from asyncrl.rollout.types import RolloutSample, TrainingSequence
from asyncrl.trainer.flops import forward_flops, peak_tflops, row_flops
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.token_logprobs import compute_token_logprobs

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Qwen3.5-2B's text model: 24 layers, three gated-DeltaNet layers per attention layer.
    "qwen3.5-2b": dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                       tie_word_embeddings=True),
}  # fmt: skip
"""Model shapes from the public configs; random weights are built in the run."""
TINY_CASCADE = "cascade-cpu"
"""--tiny times and checks `cascade` with its reference kernel (float32 torch) under this name."""


def build_config(shape: str, tiny: bool) -> Any:
    """The shape's config (Qwen3 or the Qwen3.5 hybrid text model); ``tiny`` shrinks it for a CPU rehearsal."""
    from transformers import Qwen3_5TextConfig

    fields = dict(SHAPES[shape], max_position_embeddings=40960)
    if tiny:
        fields |= dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
    if shape.startswith("qwen3.5"):
        return Qwen3_5TextConfig(**fields)
    return Qwen3Config(**{k: v for k, v in fields.items() if not k.startswith("linear_")})


def build_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def grpo_samples(num_groups: int, vocab: int, seed: int, scale: float = 1.0) -> list[RolloutSample]:
    """Groups of 8: prompt 512-2048 tokens, completions 128-2048 from a log-normal tail (median ~400)."""
    rng = random.Random(seed)
    samples = []
    for group in range(num_groups):
        prompt = [rng.randrange(vocab) for _ in range(int(rng.randint(512, 2048) * scale))]
        for rollout in range(8):
            length = int(min(2048, max(128, rng.lognormvariate(6.0, 0.8))) * scale)
            tokens = prompt + [rng.randrange(vocab) for _ in range(max(length, 1))]
            mask = [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
            sequence = TrainingSequence(tokens, mask, [-rng.random() for _ in tokens])
            samples.append(RolloutSample(sequence, rng.gauss(0, 1), 0.0, group, group, group, 0, f"{group}-{rollout}"))
    return samples


# ---- the three ways to forward ------------------------------------------------------------------------------


@dataclass
class Batch:
    """What one fwd+bwd consumes, whichever layout."""

    run: Callable[[], None]
    raw: int
    forwarded: int
    trained: int
    samples: int
    flops: float


def packed_batches(model, samples, packer, budget, attention, config, chunk: int, compile_layers: bool | str
                   ) -> tuple[list[Batch], float]:  # fmt: skip
    started = time.perf_counter()
    micro_batches, _ = plan_micro_batches(samples, lambda: packer(budget), 1, budget)
    rows = [mb[0].pack(top_k=0) for mb in micro_batches]
    pack_s = time.perf_counter() - started
    device = next(model.parameters()).device

    def step(row: PackedRow) -> Callable[[], None]:
        advantages = row.advantages.to(device)

        def run() -> None:
            out = packed_forward(model, row, 1.0, attention=attention, logit_chunk_tokens=chunk,
                                 compile_layers=compile_layers)  # fmt: skip
            (-(out.logprobs * advantages).sum() / row.num_trained).backward()

        return run

    batches = [Batch(step(r), r.num_raw_tokens, r.num_forwarded, r.num_trained, len(r.samples),
                     row_flops(config, r)) for r in rows]  # fmt: skip
    return batches, pack_s


def padded_batches(model, samples, budget, config, chunk: int) -> list[Batch]:
    """Arrival order, as many samples per batch as keep batch x longest within the budget."""
    groups, current = [], []
    for sample in samples:
        if current and (len(current) + 1) * max(s.num_tokens for s in [*current, sample]) > budget:
            groups.append(current)
            current = []
        current.append(sample)
    groups.append(current)
    return [_padded_batch(model, group, config, chunk) for group in groups]


def _padded_batch(model, group: list[RolloutSample], config, chunk: int) -> Batch:
    device = next(model.parameters()).device
    width = max(s.num_tokens for s in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    attention_mask = torch.zeros(len(group), width, dtype=torch.long)
    flat_index, targets, advantages = [], [], []
    for b, sample in enumerate(group):
        tokens = sample.sequence.token_ids
        ids[b, : len(tokens)] = torch.tensor(tokens)
        attention_mask[b, : len(tokens)] = 1
        for i in range(1, len(tokens)):
            if sample.sequence.mask[i]:
                flat_index.append(b * width + i - 1)
                targets.append(tokens[i])
                advantages.append(sample.advantage)
    ids, attention_mask = ids.to(device), attention_mask.to(device)
    index, target = torch.tensor(flat_index, device=device), torch.tensor(targets, device=device)
    adv = torch.tensor(advantages, device=device)

    def run() -> None:
        hidden = model.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[index]
        logprobs = compute_token_logprobs(hidden, model.lm_head, target, 1.0, chunk_tokens=chunk).logprobs
        (-(logprobs * adv).sum() / len(targets)).backward()

    raw = sum(s.num_tokens for s in group)
    pairs = sum(s.num_tokens * (s.num_tokens + 1) // 2 for s in group)
    return Batch(
        run, raw, len(group) * width, len(targets), len(group), 3.0 * forward_flops(config, raw, len(targets), pairs)
    )


# ---- measuring ----------------------------------------------------------------------------------------------


def measure(model, batches: list[Batch], device: torch.device) -> dict[str, float | None]:
    """One warm-up batch, then every batch once: fwd+bwd seconds, throughput, peak memory, MFU. Each batch is
    timed alone too: the warm-up's seconds are the first call's cost (kernels compiled and autotuned), and a timed
    row far over the median is one that compiled again (the trainer's slow first real step at the 2B shape)."""
    _sync(device)
    started = time.perf_counter()
    batches[0].run()
    model.zero_grad(set_to_none=True)
    _sync(device)
    warm_up_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row_s = []
    for batch in batches:
        started = time.perf_counter()
        batch.run()
        _sync(device)
        row_s.append(time.perf_counter() - started)
    seconds = sum(row_s)
    model.zero_grad(set_to_none=True)
    trained = sum(b.trained for b in batches)
    peak = peak_tflops(device, "bf16")  # the datasheet's dense bf16 figure (an H200: 989.5; a large matmul: ~790)
    return {
        "rows": len(batches),
        "samples_per_row": sum(b.samples for b in batches) / len(batches),
        "packing_ratio": sum(b.raw for b in batches) / sum(b.forwarded for b in batches),
        "forwarded_per_row": sum(b.forwarded for b in batches) / len(batches),
        "seconds": seconds,
        "trained_per_s": trained / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "mfu": sum(b.flops for b in batches) / seconds / (peak * 1e12) if peak else None,
        "warm_up_s": warm_up_s,
        "row_s_median": statistics.median(row_s),
        "row_s_max": max(row_s),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def exactness(model, reference, samples: list[RolloutSample], attentions: list[str],
              compile_layers: bool | str = False) -> list[dict[str, Any]]:  # fmt: skip
    """Max and mean |packed - alone| log-probability per backend (alone: transformers' SDPA, same weights)."""
    device = next(model.parameters()).device
    results = []
    with torch.no_grad():
        expected = []
        for sample in samples:
            tokens = torch.tensor(sample.sequence.token_ids, device=device)
            logprobs = reference(input_ids=tokens[None], use_cache=False).logits[0, :-1].float().log_softmax(-1)
            mask = torch.tensor(sample.sequence.mask[1:], dtype=torch.bool, device=device)
            expected.append(logprobs.gather(1, tokens[1:, None]).squeeze(1)[mask])
        expected_all = torch.cat(expected)
        for name, packer in (("tree", TreeRow), ("flat", FlatRow)):
            row = packer(10**6)
            for sample in samples:
                row.add(sample)
            packed_row = row.pack(top_k=0)
            for attention in attentions:
                result: dict[str, Any] = {"layout": name, "attention": attention, "dtype": str(model.dtype)}
                try:
                    out = packed_forward(model, packed_row, 1.0, attention=attention, compile_layers=compile_layers)
                    diff = (out.logprobs - expected_all).abs()
                    result |= {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}
                except Exception as exc:  # reported, so that the other backends still get measured
                    result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results.append(result)
    return results


def profile_top(run: Callable[[], None], device: torch.device, limit: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        run()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=limit, max_name_column_width=60)
    return table + "\n" + _movement_by_shape(prof, device, limit)


def _movement_by_shape(prof: Any, device: torch.device, limit: int) -> str:
    """The data-movement operators (copies, casts, gathers) split by input shapes: which tensors they move."""
    moving = ("aten::copy_", "aten::index", "aten::index_add_", "aten::index_select", "aten::gather", "aten::cat")
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in moving]
    attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events.sort(key=lambda e: getattr(e, attribute, 0.0), reverse=True)
    lines = [f"{'operator':<20} {'calls':>6} {'self ms':>9}  input shapes"]
    for event in events[:limit]:
        lines.append(f"{event.key:<20} {event.count:>6} {getattr(event, attribute, 0.0) / 1000:>9.2f}  "
                     f"{str(event.input_shapes)[:150]}")  # fmt: skip
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=24, help="prompts, 8 completions each")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--attention", nargs="+", default=["varlen"],
                        help="backends timed for tree packing (flat uses the first)")  # fmt: skip
    parser.add_argument("--exact-attention", nargs="+", default=["varlen", "flex"],
                        help="backends checked for exactness")  # fmt: skip
    parser.add_argument("--logit-chunk-tokens", type=int, default=4096, help="trainer.logit_chunk_tokens (0 = all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the runs with torch.compile'd layers")
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny model, short samples, sdpa and "
                        "cascade's reference kernel")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print the top kernels of one flat and one tree row")
    parser.add_argument("--conv", choices=["fla", "reference"], default="fla",
                        help="gated-DeltaNet convolution on CUDA: fla's Triton kernel (the trainer's) or transformers' "
                        "depthwise F.conv1d, to measure one against the other")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="model shape (random weights)")
    return parser.parse_args()


Run = tuple[str, str, list[Batch], float]


def timing_runs(model, samples, budget: int, attentions: list[str], config, chunk: int,
                compile_layers: bool | str) -> list[Run]:  # fmt: skip
    """Padded (eager only), flat and tree batches; compile_layers as the trainer's trainer.compile_layers."""
    runs: list[Run] = []
    if not compile_layers:
        model.set_attn_implementation("sdpa")
        runs.append(("padded", "sdpa", padded_batches(model, samples, budget, config, chunk), 0.0))
    for mode, packer, names in (("flat", FlatRow, attentions[:1]), ("tree", TreeRow, attentions)):
        for attention in names:
            batches, pack_s = packed_batches(model, samples, packer, budget, attention, config, chunk, compile_layers)
            runs.append((mode, attention, batches, pack_s))
    return runs


def time_runs(model, runs: list[Run], budget: int, layers: str, device, results: list[dict[str, Any]]) -> None:
    for mode, attention, batches, pack_s in runs:
        if mode == "padded":
            model.set_attn_implementation("sdpa")
        try:
            stats: dict[str, Any] = measure(model, batches, device)
        except Exception as exc:  # an OOM or a backend that fails here is a result of the table, not the end
            stats = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            model.zero_grad(set_to_none=True)
        results.append({"budget": budget, "mode": mode, "attention": attention, "layers": layers,
                        "pack_s": pack_s, **stats})  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _print_row(results[-1], results, flush=True)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.conv == "reference":
        deltanet._fla_conv = lambda: None
    config = build_config(args.shape, args.tiny)
    torch.manual_seed(args.seed)
    with device:
        model = build_model(config).to(torch.float32 if args.tiny else torch.bfloat16)
    model.train()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    if args.tiny and TINY_CASCADE not in ATTENTION:
        ATTENTION.register(TINY_CASCADE)(functools.partial(cascade_plan, kernel=ReferenceKernel()))
    attentions = ["sdpa", TINY_CASCADE] if args.tiny else args.attention
    exact_attentions = ["sdpa", "flex", TINY_CASCADE] if args.tiny else args.exact_attention
    scale = 1 / 16 if args.tiny else 1.0
    budgets = [int(b * scale) for b in args.budgets]
    chunk = args.logit_chunk_tokens
    chunk = max(1, int(chunk * scale)) if chunk else 0
    samples = grpo_samples(args.groups, config.vocab_size, args.seed, scale)
    exact_samples = grpo_samples(2, config.vocab_size, args.seed + 1, scale * 0.5)
    header = {"shape": args.shape, "conv": args.conv,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "samples": len(samples), "raw_tokens": sum(s.num_tokens for s in samples),
              "trained_tokens": sum(s.num_trained for s in samples), "logit_chunk_tokens": chunk}  # fmt: skip
    print(" ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    print(_HEADER, flush=True)

    results: list[dict[str, Any]] = []
    for index, budget in enumerate(budgets):
        runs = timing_runs(model, samples, budget, attentions, config, chunk, compile_layers=False)
        time_runs(model, runs, budget, "eager", device, results)
        if args.profile and index == 0:
            _profile(model, runs[1:3], device)
    exact = exactness(model, reference, exact_samples, exact_attentions)
    if not args.no_compile:
        compile_started = time.perf_counter()
        compile_layers = "aot_eager" if args.tiny else True  # aot_eager: no C++ code generation on CPU
        for budget in budgets:
            runs = timing_runs(model, samples, budget, attentions, config, chunk, compile_layers)
            time_runs(model, runs, budget, "compiled", device, results)
        print(f"compiled runs (compilation included) took {time.perf_counter() - compile_started:.0f} s", flush=True)
        compiled = exactness(model, reference, exact_samples, attentions, compile_layers)
        exact += [{**e, "layers": "compiled"} for e in compiled]

    print("\n" + _HEADER)
    for result in results:
        _print_row(result, results)
    for e in exact:
        label = f"{e['layout']}/{e['attention']}" + ("/compiled" if "layers" in e else "")
        detail = e.get("error") or f"max|diff|={e['max_abs_diff']:.3e} mean|diff|={e['mean_abs_diff']:.3e}"
        print(f"exactness {e['dtype']} {label:22s} {detail}", flush=True)
    total_s = time.perf_counter() - started
    print(f"total {total_s:.0f} s", flush=True)
    _write_json({**header, "total_s": total_s, "runs": results, "exactness": exact})


def _profile(model, runs: list[Run], device: torch.device) -> None:
    for mode, attention, batches, _ in runs:
        print(f"profile: one {mode}/{attention} row of {batches[0].forwarded} tokens", flush=True)
        print(profile_top(batches[0].run, device), flush=True)
        model.zero_grad(set_to_none=True)


def _write_json(payload: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "packing.json"
        path.write_text(json.dumps(payload, indent=1, default=str, allow_nan=False))
        print(f"wrote {path}", flush=True)


_HEADER = (
    f"{'budget':>6} {'mode':>6} {'attn':>7} {'layers':>8} {'rows':>5} {'smp/row':>7} {'ratio':>6} {'tok/row':>8} "
    f"{'fwd+bwd s':>9} {'trained tok/s':>13} {'vs flat':>7} {'peak GiB':>8} {'MFU':>6} {'pack s':>6} {'warm s':>7} "
    f"{'row s med/max':>13}"
)


def _print_row(r: dict[str, Any], results: list[dict[str, Any]], flush: bool = False) -> None:
    lead = f"{r['budget']:>6} {r['mode']:>6} {r['attention']:>7} {r['layers']:>8}"
    if "error" in r:
        print(f"{lead}  {r['error']}", flush=flush)
        return
    flat = next((f for f in results if f["budget"] == r["budget"] and f["mode"] == "flat"
                 and f["layers"] == r["layers"] and "error" not in f), None)  # fmt: skip
    speedup = r["trained_per_s"] / flat["trained_per_s"] if flat else float("nan")
    print(
        f"{lead} {r['rows']:>5} {r['samples_per_row']:>7.2f} {r['packing_ratio']:>6.2f} {r['forwarded_per_row']:>8.0f} "
        f"{r['seconds']:>9.2f} {r['trained_per_s']:>13,.0f} {speedup:>7.2f} {r['peak_gib'] or float('nan'):>8.1f} "
        f"{100 * (r['mfu'] or float('nan')):>5.1f}% {r['pack_s']:>6.2f} {r['warm_up_s']:>7.2f} "
        f"{r['row_s_median']:>6.2f}/{r['row_s_max']:<6.2f}",
        flush=flush,
    )


if __name__ == "__main__":
    main()
