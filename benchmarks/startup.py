"""A small model's first step from launch, by vLLM's launch flags (issue 53, item 5).

    python benchmarks/startup.py --model DIR --work /tmp/tta --variants as-is,O0,graphs --out $OUT       # cold
    python benchmarks/startup.py --model DIR --work /tmp/tta --variants O0,graphs --warm --out $OUT      # again

At 135M asyncrl's vLLM became healthy 144 s after its launch, cold (session 30: 8 API server processes, vLLM's
torch.compile and its CUDA-graph captures, profiling a 71.6 GiB KV cache), while the trainer's own compiled warm-up
was done 52.6 s from launch: the server bounds the first step. Each variant here is the time-to-accuracy run as
typed (benchmarks/time_to_accuracy.py: SmolLM2-135M-Instruct, its own-task files, before-training evaluation
included) with the variant's overrides and ``--steps`` steps, compile caches of its own under ``--work``/caches
(removed first unless ``--warm``), so a variant's first run is cold and its ``--warm`` run is a user's second run.

The variants (``server.api_server_count``, and vLLM's ``-O`` levels or compilation options through
``server.extra_args``):

- ``as-is``: asyncrl's command today (8 API servers on vLLM >= 0.32, vLLM's default -O2: Inductor compile, full and
  piecewise CUDA graphs);
- ``api1``: one API server;
- ``O1``: one API server, -O1 (compile, piecewise CUDA graphs only);
- ``graphs``: one API server, no compile, full CUDA graphs for decode steps only (``-cc.mode=NONE
  -cc.cudagraph_mode=FULL_DECODE_ONLY``): the decode launches that dominate a small model, without Inductor;
- ``O0``: one API server, -O0 (no compile, no CUDA graphs: vLLM's fastest start).

Per run: the console's startup line (model loaded, warm-up done, server healthy, first step: seconds from launch),
the median step time and generated tokens/s over steps 3 and later (the steady rate a flag may cost), and vLLM's
own timings from its log (torch.compile, graph capture, engine init). Writes startup.json and startup.md to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import time_to_accuracy as tta  # noqa: E402
import vs_trl  # noqa: E402

ONE_SERVER = "server.api_server_count=1"
VARIANTS: dict[str, list[str]] = {
    "as-is": [],
    "api1": [ONE_SERVER],
    "O1": [ONE_SERVER, "server.extra_args=['-O1']"],
    "graphs": [ONE_SERVER, "server.extra_args=['-cc.mode=NONE','-cc.cudagraph_mode=FULL_DECODE_ONLY']"],
    "O0": [ONE_SERVER, "server.extra_args=['-O0']"],
}
STARTUP = re.compile(r"startup \(seconds since launch\): (.*)")
PHASE = re.compile(r"([a-z ]+?) ([\d.]+) s")
VLLM_TIMINGS = re.compile(
    r"(torch\.compile takes [\d.]+ s in total|Graph capturing finished in [\d.]+ secs"
    r"|init engine .*? took [\d.]+ seconds|Model loading took [\d.]+ \w+ .*? [\d.]+ s\w*)"
)


def startup_phases(console: str) -> dict[str, float]:
    """The console's startup line as {phase: seconds from launch}."""
    match = STARTUP.search(console)
    return {name.strip(): float(s) for name, s in PHASE.findall(match[1])} if match else {}


def vllm_timings(run_dir: Path) -> list[str]:
    """vLLM's own start-up timing lines from the run's server log, in order."""
    logs = sorted((run_dir / "logs").glob("server*.log"))
    return [m for log in logs for m in VLLM_TIMINGS.findall(log.read_text(errors="replace"))]


def steady(rows: list[dict[str, Any]], skip: int = 2) -> dict[str, float | None]:
    """Median step seconds and generated tokens/s after the first ``skip`` steps."""
    later = rows[skip:]
    step_s = [r["step_s"] for r in later if r.get("step_s") is not None]
    rates = [r["generated_tokens"] / r["step_s"] for r in later if r.get("generated_tokens") and r.get("step_s")]
    return {"median_step_s": statistics.median(step_s) if step_s else None,
            "median_gen_tok_s": statistics.median(rates) if rates else None}  # fmt: skip


def run_variant(name: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The time-to-accuracy command with ``name``'s overrides, through vs_trl's runner (caches per variant)."""
    plan = tta.plan_of(args)
    typed = [*tta.asyncrl_typed(model, args.work / tta.DATA, plan, 0, False), "trainer.save_strategy=no",
             *VARIANTS[name]]  # fmt: skip
    label = f"startup-{name}"
    result = vs_trl.run_asyncrl(label, model, plan.workload(), args, typed=typed)
    run_dir = args.work / "runs" / f"{label}-asyncrl"
    console = (args.work / "runs" / f"{label}-asyncrl.out").read_text(errors="replace")
    return {"variant": name, "caches": "warm" if args.warm else "cold", "rc": result["rc"],
            "overrides": VARIANTS[name], "startup": startup_phases(console), **steady(result["rows"]),
            "steps": len(result["rows"]), "vllm": vllm_timings(run_dir), "failure": result["failure"]}  # fmt: skip


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | caches | model loaded | warm-up done | server healthy | first step | median step s (step 3+) "
        "| gen tok/s (median) | vLLM's own timings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["startup"]
        cells = [s.get(k) for k in ("model loaded", "warm up", "server healthy", "first step")]
        lines.append(f"| {r['variant']} | {r['caches']} | " + " | ".join(tta._f(c) for c in cells)
                     + f" | {tta._f(r['median_step_s'], 2)} | {tta._f(r['median_gen_tok_s'], 0)} | "
                     + ("; ".join(r["vllm"]) or r["failure"] or "") + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the checkpoint (real_checkpoints.py build)")
    parser.add_argument("--work", type=Path, required=True, help="data, runs and caches (time_to_accuracy's)")
    parser.add_argument("--variants", default="as-is,graphs,O0", help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps of each run (default 12)")
    parser.add_argument("--warm", action="store_true", help="keep each variant's caches from an earlier run")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds each run may take (default 240)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.rehearse, args.save_steps, args.trl_batch, args.max_tokens = False, None, None, None
    args.eval_prompts, args.lr, args.data_seed = None, 2e-5, 0
    args.work, args.out = args.work.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    tta.write_task(args.work / tta.DATA, args.data_seed)
    saved = args.out / "startup.json"
    runs = json.loads(saved.read_text()) if saved.is_file() else []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {name!r}; of {', '.join(VARIANTS)}")
        runs.append(run_variant(name, args.model.resolve(), args))
        saved.write_text(json.dumps(runs, indent=1))
        (args.out / "startup.md").write_text(table(runs) + "\n")
        print(table(runs[-1:]).splitlines()[-1], flush=True)
    print(table(runs))


if __name__ == "__main__":
    main()
