"""Compiling one fla kernel's autotune candidates one after another, as Triton's autotuner does, against all at once
on a pool of threads, as asyncrl/trainer/autotune.py does before Triton times them. Compiles for a GPU target
named on the command line, so it runs on a machine without a GPU (Triton's compiler and ptxas are in its wheel);
each measurement compiles into a fresh Triton cache. Needs fla (``fla-core``) and Triton.

    python benchmarks/triton_compile.py                       # l2norm_fwd_kernel's 25 configs for sm_90
    python benchmarks/triton_compile.py --threads 1,2,4,8,1 --arch 90
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SIGNATURE = {"x": "*bf16", "y": "*bf16", "rstd": "*fp32", "eps": "fp32", "T": "i32",
             "D": "constexpr", "BD": "constexpr", "NB": "constexpr", "BT": "constexpr"}  # fmt: skip
"""fla's l2norm_fwd_kernel as the gated-DeltaNet layers launch it: bfloat16 rows of 128, NB 4 (a 16k-token row)."""


def compile_config(config: Any, arch: int) -> None:
    """One candidate of l2norm_fwd_kernel compiled for ``sm_{arch}``, as a launch with it would."""
    import triton
    from fla.modules.norm.l2norm import l2norm_fwd_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {"D": 128, "BD": 128, "NB": 4, "BT": config.kwargs["BT"]}
    source = ASTSource(l2norm_fwd_kernel.fn, SIGNATURE, constexprs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def seconds_to_compile(threads: int, arch: int) -> float:
    """Every config of the kernel compiled on ``threads`` threads (1: one after another), into a fresh cache."""
    from fla.modules.norm.l2norm import l2norm_fwd_kernel

    with tempfile.TemporaryDirectory(prefix="triton-compile-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda config: compile_config(config, arch), l2norm_fwd_kernel.configs))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2,1,2", help="comma-separated thread counts, measured in this order")
    parser.add_argument("--arch", type=int, default=90, help="the CUDA target's compute capability (default 90)")
    args = parser.parse_args()
    from fla.modules.norm.l2norm import l2norm_fwd_kernel

    print(f"l2norm_fwd_kernel: {len(l2norm_fwd_kernel.configs)} configs for sm_{args.arch}, {os.cpu_count()} CPUs")
    print("| threads | seconds |\n|---|---|")
    for threads in (int(n) for n in args.threads.split(",")):
        print(f"| {threads} | {seconds_to_compile(threads, args.arch):.2f} |", flush=True)


if __name__ == "__main__":
    main()
