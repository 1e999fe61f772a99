"""The rollout worker's CPU per rollout (issue 53, item 4): near convergence completions are a few tokens and the
worker's one event loop (the HTTP request, rendering, scoring, the samples' hand-over), not the server, bounds how
many rollouts a second a run gets: session 32's real-model row generated ~450 rollouts/s of 8-10 tokens on an H100.

Each configuration is one `asyncrl train` of the embedded default (the built-in server on a CPU, or whatever the
overrides choose). A ``sitecustomize`` put on the run's PYTHONPATH wraps the worker's entry point and the client's
request: it writes the worker's CPU seconds (``time.process_time``, all its threads) from its first request to its
exit, and the rollouts and requests it sent. So the figure is the worker's own cost, whatever the server's speed.

    python benchmarks/worker_cpu.py                                   # group requests on and off, 15 steps each
    python benchmarks/worker_cpu.py --runs 2 -- trainer.max_steps=30  # more, longer runs

Prints one line per run and writes worker_cpu.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

HOOK = """
import importlib.machinery, json, os, sys, time

COUNTS = {"first": None, "requests": 0, "rollouts": 0}


class WorkerCpu:
    def find_spec(self, name, path, target=None):
        if name != "asyncrl.rollout.worker":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import asyncrl.client as client

            send = client.GenerationClient._send

            async def counted(self, path, body, rollouts):
                COUNTS["first"] = COUNTS["first"] or time.process_time()
                COUNTS["requests"] += 1
                COUNTS["rollouts"] += rollouts
                return await send(self, path, body, rollouts)

            client.GenerationClient._send = counted
            entry = module.worker_entry

            def worker_entry(*args, **kwargs):
                try:
                    return entry(*args, **kwargs)
                finally:
                    cpu = time.process_time() - (COUNTS["first"] or time.process_time())
                    with open(os.environ["WORKER_CPU_OUT"], "w") as out:
                        out.write(json.dumps({**COUNTS, "cpu_s": cpu}))

            worker_entry.__module__, worker_entry.__qualname__ = module.__name__, "worker_entry"  # spawn pickles it
            module.worker_entry = worker_entry

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, WorkerCpu())
"""


def run(label: str, overrides: list[str], work: Path) -> dict[str, Any]:
    """One `asyncrl train` with the hook: the worker's CPU seconds, rollouts and requests."""
    hooks, out, run_dir = work / "hooks", work / f"{label}.json", work / label
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(filter(None, [str(hooks), str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "WORKER_CPU_OUT": str(out), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "asyncrl", "train", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{label}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    counts = json.loads(out.read_text())
    return {"label": label, "overrides": overrides, **counts,
            "ms_per_rollout": 1000 * counts["cpu_s"] / max(counts["rollouts"], 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --); default trainer.max_steps=15")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="worker_cpu-"))
    extra = args.extra or ["trainer.max_steps=15"]
    results = []
    for index in range(args.runs):
        for grouped in ("true", "false"):
            result = run(f"group_requests_{grouped}_{index}", [*extra, f"rollout.group_requests={grouped}"], work)
            results.append(result)
            print(f"{result['label']}: {result['ms_per_rollout']:.3f} ms of worker CPU per rollout "
                  f"({result['cpu_s']:.2f} s, {result['rollouts']} rollouts, {result['requests']} requests)",
                  flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "worker_cpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
