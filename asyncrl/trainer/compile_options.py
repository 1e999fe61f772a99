"""The Inductor options every torch.compile of the trainer passes (decoder layers, log-probability epilogues).

Compiled with dynamic shapes, a graph is still guarded on the row length wherever Inductor took a choice by it. Its
mix-order reduction (a norm's backward fused with the column sum of its weight's gradient, Triton only) is taken
only above size thresholds (rows x columns >= 5 Mi elements, rows >= 4096, rows >= 2 x columns), and each check
becomes a guard on the row length: on the H200 at the Qwen3-0.6B shape the rows fell into four ranges (< 2560,
< 4096, < 5120 and longer tokens), the warm-up's full and short rows compiled two of them, and the first real row
in another compiled again for 13.7 s mid-run (benchmarks/RESULTS.md, issue 36; at the Qwen3-4B shape ~24 s).
Inductor's non-strict mode skips those checks (its config: "helpful to avoid recompilations"), so one graph serves
every length; what it gives up is the unfused kernel for rows too short for the fusion to pay.
"""

from __future__ import annotations

NON_STRICT_FLAG = "mix_order_reduction_non_strict_mode"
NON_STRICT_MIX_ORDER = f"triton.{NON_STRICT_FLAG}"


def inductor_options(backend: str) -> dict[str, object] | None:
    """torch.compile's ``options`` for ``backend``: for Inductor, the mix-order reduction without its row-length
    checks where this torch has it; None for other backends, which take no Inductor options."""
    if backend != "inductor":
        return None
    from torch._inductor import config

    return {NON_STRICT_MIX_ORDER: True} if hasattr(config.triton, NON_STRICT_FLAG) else None
