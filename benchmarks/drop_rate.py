"""Step time against the share of groups dropped for zero spread (issue 53, item 4): near convergence most groups
score the same for every rollout and are dropped, and a step waits for a token budget of kept groups.

The reward (``drop_some``) gives every rollout of a chosen fraction of prompts the same value (the group is dropped,
zero_std) and the others their closeness to a target length, which varies within a group (benchmarks/e2e.py's
length-controlled loop draws each rollout's length). Which prompts drop is a hash of the prompt, so the fraction is
the same at every speed. Each fraction is one `asyncrl train` run on the e2e benchmark's tiny random model with the
server it launches (the built-in one on a CPU, vLLM on a GPU); the figure is the median ``perf/step_s`` after the
first steps.

    python benchmarks/drop_rate.py                                # 0% and 70% dropped, 30 steps each, on the CPU
    python benchmarks/drop_rate.py --fractions 0,0.7 --prompts 64 --steps 40 -- data.retire_solved_after=2
    python benchmarks/drop_rate.py --shape 0.6b --device cuda     # the 0.6B shape (a GPU)
    python benchmarks/drop_rate.py --shape 0.6b --device cuda --warm-up-timeout 260 --steps 12 --run-timeout 140
    python benchmarks/drop_rate.py --from-metrics RUN/metrics.jsonl   # a real run's steps, by the share it dropped

Anything after ``--`` is passed to every run as overrides. Prints one line per fraction and the ratio of each to the
first; writes drop_rate.json under --out. ``--from-metrics`` runs nothing: it reads a finished run's metrics (a real
model learning its task, whose share of zero-spread groups rises as it converges) and compares the steps that dropped
at most 35% of their groups with those that dropped at least 70% (``by_drop_rate``).

On 2 CPU cores shared with other jobs (issue 53, medians of steps 6-30; before = admission counting every token in
flight, after = at the kept share), 70% dropped took 2.1-4.6x the step of 0% before (4 runs: the trainer waited
0.36-0.78 s a step for rollouts, ~45-50 in flight under a cap of 80: the allowance bound them) and 1.7-2.0x after
(4 runs: 0.14-0.38 s of waiting, the cap full: the CPU's generation rate bounds it, as 70% dropped needs 3.3x the
tokens generated a step); with data.retire_solved_after=2 on 64 prompts, 1.47x over steps 11-40.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(Path(__file__).resolve().parent))  # e2e.py and vs_trl.py beside it, as a script has them (pytest
# imports this file where benchmarks/ is no package of its path)

import vs_trl  # noqa: E402
from e2e import GROUP_SIZE, WORKLOAD, build_assets  # noqa: E402

from asyncrl.metrics import read_jsonl  # noqa: E402
from asyncrl.serving.process import free_port  # noqa: E402


def drop_some(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]], *,
              drop_fraction: float = 0.0, target: int = 12, **columns: Any) -> list[float]:  # fmt: skip
    """1.0 for every rollout of ``drop_fraction`` of the prompts (chosen by a hash of the prompt: its group is dropped
    for zero spread); elsewhere minus the distance of the completion's length to ``target``, scaled to (-1, 0]."""
    if zlib.crc32(repr(prompts[0]).encode()) % 10_000 < drop_fraction * 10_000:
        return [1.0] * len(completion_ids)
    return [-abs(len(ids) - target) / (1 + target + len(ids)) for ids in completion_ids]


def server_overrides(device: str) -> list[str]:
    """On a GPU the vLLM a user's run launches (the built-in server would bound the step there); on a CPU the
    built-in one."""
    if device == "cuda":
        return ["server.backend=vllm", "server.dtype=bfloat16"]
    return ["server.backend=builtin", f"server.device={device}", "server.dtype=float32"]


def overrides(args: argparse.Namespace, model_dir: Path, data: Path, fraction: float, steps: int) -> list[str]:
    _, median, sigma, max_len, budget = WORKLOAD[args.shape]
    return [
        f"model.name_or_path={model_dir}", f"data.path={data}", "data.eval_path=null",
        f"reward_funcs=[{{name: benchmarks.drop_rate:drop_some, drop_fraction: {fraction}, target: {median}}}]",
        "loss=clipped", f"sampling.num_generations={GROUP_SIZE}", f"sampling.max_completion_length={max_len}",
        "sampling.num_sampler_logprobs=0", "rollout.loop_cls=benchmarks.e2e:LengthControlledLoop",
        f"++rollout.options={{median_tokens: {median}, sigma: {sigma}}}", "rollout.max_consecutive_dropped_groups=null",
        *server_overrides(args.device), f"server.port={free_port()}",
        f"packing.token_budget={budget}", f"trainer.max_steps={steps}", "trainer.save_strategy=no",
        "trainer.learning_rate=1e-6", "logging.console=plain", "logging.report=false",
    ]  # fmt: skip


def run(args: argparse.Namespace, model_dir: Path, data: Path, fraction: float, *, warm_up: bool = False
        ) -> dict[str, Any]:  # fmt: skip
    """One `asyncrl train` at ``fraction`` dropped, stopped (SIGTERM, then SIGKILL) at --run-timeout: its figures over
    the steps it made (``summary``). A run stopped there still counts (``cut``): a cold vLLM start at the 0.6B shape
    took 200 s of a 200 s limit before its first step (session 40), and the steps it made are the measurement.
    ``warm_up``: WARM_UP_STEPS steps within --warm-up-timeout, which fill the caches the measured runs share."""
    stem = "warm_up" if warm_up else f"drop{fraction:g}"
    steps, limit = (WARM_UP_STEPS, args.warm_up_timeout) if warm_up else (args.steps, args.run_timeout)
    run_dir = args.work / stem
    argv = [sys.executable, "-m", "asyncrl", "train", *overrides(args, model_dir, data, fraction, steps),
            f"hydra.run.dir={run_dir}", *args.extra]  # fmt: skip
    started = time.perf_counter()
    rc = vs_trl.execute(argv, args.work, stem, args.work / "caches", limit)  # caches shared: warm after
    if rc not in (0, None):  # the first run; the medians leave the start-up out
        print((args.work / f"{stem}.err").read_text()[-3000:], flush=True)
        raise SystemExit(f"the run at {fraction:g} dropped failed (exit {rc}; console in {args.work / stem}.out|err)")
    metrics = run_dir / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.is_file() else []
    return {"drop_fraction": fraction, "wall_s": time.perf_counter() - started, "cut": rc is None,
            **summary(rows, args.skip)}  # fmt: skip


def summary(rows: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Medians over the steps after the first ``skip`` (start-up) of what bounds a step; NaN where no step is left."""
    kept = rows[skip:]

    def median(key: str) -> float:
        values = [float(r[key]) for r in kept if isinstance(r.get(key), int | float)]
        return statistics.median(values) if values else float("nan")

    return {
        "steps": len(rows), "measured_steps": len(kept),
        "step_s": median("perf/step_s"), "rollout_wait_s": median("perf/rollout_wait_s"),
        "zero_std_frac": median("frac_reward_zero_std"), "concurrency": median("rollout/concurrency"),
        "backpressure_s": median("rollout/backpressure_s"), "samples_per_step": median("batch/samples_per_step"),
        "staleness_mean": median("sample/staleness_mean"),
        "generated_tokens_per_s": median("rollout/generated_tokens_per_s"),
        "worker_cpu": median("rollout/worker_cpu"),
    }  # fmt: skip


WARM_UP_STEPS = 2
"""The warm-up run's steps (--warm-up-timeout): enough to compile the trainer's step and vLLM's graphs."""
LOW_DROP, HIGH_DROP = 0.35, 0.7
"""A real run's steps that dropped at most LOW_DROP of their groups are its baseline; those at HIGH_DROP or more,
the issue's 70%."""


def by_drop_rate(rows: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """A finished run's steps after the first ``skip``, in two bins by ``frac_reward_zero_std`` (steps that logged
    none are left out): the median and mean ``perf/step_s`` of each, and their ratio, high over low. Why a real run as
    well as ``run``'s fixed fractions: the share dropped rises with accuracy while completions shorten and the policy
    sharpens, which the synthetic reward does not reproduce."""
    timed = [
        (float(r["frac_reward_zero_std"]), float(r["perf/step_s"]))
        for r in rows[skip:]
        if isinstance(r.get("frac_reward_zero_std"), int | float) and isinstance(r.get("perf/step_s"), int | float)
    ]
    low = [s for f, s in timed if f <= LOW_DROP]
    high = [s for f, s in timed if f >= HIGH_DROP]

    def figures(steps: list[float]) -> dict[str, float]:
        if not steps:
            return {"steps": 0, "median_s": float("nan"), "mean_s": float("nan")}
        return {"steps": len(steps), "median_s": statistics.median(steps), "mean_s": statistics.fmean(steps)}

    lo, hi = figures(low), figures(high)
    ratios = {"median_ratio": hi["median_s"] / lo["median_s"], "mean_ratio": hi["mean_s"] / lo["mean_s"]}
    return {"low": lo, "high": hi, **ratios}  # NaN ratios where a bin is empty


def drop_rate_line(path: Path, figures: dict[str, Any]) -> str:
    """``by_drop_rate``'s figures of one run as one line."""
    lo, hi = figures["low"], figures["high"]
    return (
        f"{path}: {lo['steps']} steps at <= {LOW_DROP:.0%} dropped {lo['median_s']:.3f} s/step median "
        f"({lo['mean_s']:.3f} mean); {hi['steps']} at >= {HIGH_DROP:.0%} dropped {hi['median_s']:.3f} median "
        f"({hi['mean_s']:.3f} mean): {figures['median_ratio']:.2f}x median, {figures['mean_ratio']:.2f}x mean"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fractions", default="0,0.7", help="shares of prompts whose groups are dropped")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians (start-up)")
    parser.add_argument("--shape", choices=sorted(WORKLOAD), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=512, help="prompts in the data (fewer: more epochs)")
    parser.add_argument("--work", type=Path, default=None, help="assets and runs (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument(
        "--warm-up-timeout",
        type=float,
        help="first, a run of WARM_UP_STEPS steps within this limit, "
        "not compared: a machine's first vLLM start compiles (~200 s at 0.6B), the runs after it do not",
    )
    parser.add_argument("--from-metrics", type=Path, nargs="+", help="run nothing: bin these runs' steps by the "
                        "share of groups they dropped")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    if args.from_metrics:
        for path in args.from_metrics:
            print(drop_rate_line(path, by_drop_rate(read_jsonl(path), args.skip)), flush=True)
        return
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="drop_rate-"))).resolve()  # the runs start in it
    model_dir, data = build_assets(args.work / f"assets{args.prompts}", args.shape, args.prompts)
    results: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warm_up_timeout:
        warm = run(args, model_dir, data, 0.0, warm_up=True)
        print(f"warm-up run (not compared): {warm['wall_s']:.0f} s, {warm['steps']} steps", flush=True)
    for fraction in args.fractions.split(","):
        results.append(run(args, model_dir, data, float(fraction)))
        # after each run: a device call cut at its limit still returns the runs that ended
        (args.out / "drop_rate.json").write_text(json.dumps({"extra": args.extra, "results": results}, indent=1))
        print(line(results[-1], results[0]["step_s"]), flush=True)


def line(r: dict[str, Any], base: float) -> str:
    """One run's figures, its step time also as a ratio to the first run's."""
    cut = f", cut at {r['steps']} steps" if r["cut"] else ""
    return (f"dropped {r['drop_fraction']:.0%} (zero_std_frac {r['zero_std_frac']:.2f}; {r['measured_steps']} steps "
            f"measured{cut}): {r['step_s']:.3f} s/step ({r['step_s'] / base:.2f}x), rollout wait "
            f"{r['rollout_wait_s']:.3f} s, in flight {r['concurrency']:.0f}, {r['generated_tokens_per_s']:.0f} "
            f"generated tok/s, worker CPU {r['worker_cpu']:.2f}, staleness {r['staleness_mean']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
