"""fla's autotuned kernel configs, kept from the warm-up for the row lengths it did not see.

Some of fla's gated-DeltaNet kernels autotune on a key that holds a size band of the row: ``l2norm_fwd_kernel``'s
``NB = ceil(rows / 65536)``, rows = tokens x heads, so at 16 heads every 4,096-token band of row length compiles and
benchmarks its 25 configs again, in the middle of whichever step first packs a row of that band. At the Qwen3.5-2B
shape that was most of a cold first step (65 s against 15 s on warm caches: benchmarks/RESULTS.md, session 44). fla
(0.6.0, ``fla/ops/utils/cache.py``) can run such a key on a config tuned for another value of it: under
``FLA_CACHE_MODE=fuzzy`` its ``fla_cache_autotune`` kernels look a key up in ``$FLA_CONFIG_DIR/{kernel}.json`` and take
an entry whose numeric parts differ, before autotuning. It ships no writer for those files (its own are tuned
offline), so ``keep`` writes the configs the warm-up's autotuning chose, in fla's format, then turns the lookup on:
the warm-up still autotunes every kernel as before, and a later band runs on the warm-up's choice (one compile, no
benchmark). A user's own ``FLA_CACHE_MODE`` or ``FLA_CONFIG_DIR`` leaves fla as they set it."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLA_CACHE = "fla.ops.utils.cache"
_kept: str | None = None  # the FLA_CONFIG_DIR this process set: a sweep's next job (same process) may replace it


def config_dir(run_dir: Path, rank: int) -> Path:
    """A rank's kept configs: its own folder of the run, since each rank's process autotunes on its own."""
    return run_dir / "fla-configs" / f"rank-{rank}"


def tuned_kernels() -> dict[str, dict[tuple, Any]]:
    """The autotuning choices this process has made so far in fla's config-reading kernels: kernel name -> {Triton's
    autotune key: the chosen ``triton.Config``}. Found among the loaded fla modules' names, where fla defines them."""
    from fla.ops.utils.cache import CachedAutotuner

    kernels: dict[str, dict[tuple, Any]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, CachedAutotuner) and value.cache:
                kernels.setdefault(value.kernel_name, {}).update(value.cache)
    return kernels


def config_file(kernel: str, choices: dict[tuple, Any]) -> dict[str, Any]:
    """One kernel's ``{kernel}.json`` as fla reads it: an entry per autotune key, under the md5 of the key's JSON."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    entries = {}
    for key, chosen in choices.items():
        config = {"kwargs": dict(chosen.kwargs), "num_warps": chosen.num_warps, "num_stages": chosen.num_stages,
                  "num_ctas": getattr(chosen, "num_ctas", 1), "maxnreg": getattr(chosen, "maxnreg", None)}  # fmt: skip
        entries[AutotuneKey.key_hash(key)] = {"autotune_key": AutotuneKey.normalize_autotune_key(key), "config": config}
    return {"kernel_name": kernel, "triton_version": triton.__version__, "autotune_entries": entries}


def keep(directory: Path) -> int:
    """Write this process's autotuning choices under ``directory`` and have fla's kernels take them for keys they
    have not autotuned (fuzzy lookup); the number of kernels written. Nothing where fla has no config cache, no
    kernel of it has autotuned, or the user set fla's cache variables; a kernel whose key is not JSON is left to
    autotune as before."""
    if FLA_CACHE not in sys.modules:  # no fla kernel of this fla reads configs, or none was loaded: none autotuned
        return 0
    if "FLA_CACHE_MODE" in os.environ or ("FLA_CONFIG_DIR" in os.environ and not _ours()):
        return 0
    fla_cache = sys.modules[FLA_CACHE]
    files = {}
    for kernel, choices in tuned_kernels().items():
        try:
            files[kernel] = json.dumps(config_file(kernel, choices), indent=1)
        except TypeError:
            continue
    if not files:
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    for kernel, text in files.items():
        staged = directory / f".{kernel}.json.tmp"
        staged.write_text(text)
        staged.replace(directory / f"{kernel}.json")  # whole or absent: fla caches a file once it has read it
    global _kept
    _kept = os.environ["FLA_CONFIG_DIR"] = str(directory)
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.FUZZY  # fla read the variable at its import, before this
    log.info("fla's kernels keep the warm-up's autotuned configs (%d kernels, %s): a row length in another band "
             "runs on them instead of autotuning again", len(files), directory)  # fmt: skip
    return len(files)


def forget() -> None:
    """Before a warm-up: undo what an earlier run in this process kept (a sweep's jobs run in one process, a restart
    too), so that this run's kernels autotune for its own model instead of taking another's choices."""
    global _kept
    if not _ours():
        return
    del os.environ["FLA_CONFIG_DIR"]
    _kept = None
    fla_cache = sys.modules[FLA_CACHE]
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.DISABLED  # fla's mode without the variable


def _ours() -> bool:
    return _kept is not None and os.environ.get("FLA_CONFIG_DIR") == _kept
