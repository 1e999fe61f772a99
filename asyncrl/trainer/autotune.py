"""fla's kernels autotune once each per run: a key that differs only in sizes runs on the config already chosen.

Some of fla's gated-DeltaNet kernels autotune on a key that holds a size band of the row: ``l2norm_fwd_kernel``'s
``NB = ceil(rows / 65536)``, rows = tokens x heads, so at 16 heads every 4,096-token band of row length compiles and
benchmarks its 25 configs again. At the Qwen3.5-2B shape a cold warm-up compiled ~330 Triton kernels, most of them
autotune candidates, and the first real step autotuned again for its own bands (65 s against 15 s on warm caches;
benchmarks/RESULTS.md, sessions 44-45). fla (0.6.0, ``fla/ops/utils/cache.py``) can run a key on a config tuned for
another value of its numbers: under ``FLA_CACHE_MODE=fuzzy`` its ``fla_cache_autotune`` kernels look a key up in
``$FLA_CONFIG_DIR/{kernel}.json`` and take an entry whose numeric parts differ, before autotuning. It ships no writer
for those files (its own are tuned offline), so ``watch`` points fla at the run's folder, turns the lookup on and
writes each choice there as it is made: the warm-up's long row autotunes a kernel, and its short row, the other
phases and every later row-length band run on that choice (one compile, no benchmark). A key whose other parts
differ (a dtype, a flag) still autotunes. A user's own ``FLA_CACHE_MODE`` or ``FLA_CONFIG_DIR`` leaves fla alone.

A key that does autotune compiles all its configs at once first, on a pool of threads, before Triton times them
one by one (Triton compiles a config only when it times it): Triton's compile releases the GIL (fla's l2norm_fwd's
25 configs for sm_90 on a 2-core CPU: 12.3-12.7 s one after another, 6.3-6.6 s on two threads;
benchmarks/triton_compile.py, RESULTS.md session 45), and the cold 2B warm-up spent most of its 438 s compiling
candidates one at a time. Triton's own ``AsyncCompileMode`` runs the compiles; a failure there leaves each config to
compile as it is timed.

Written here rather than taken from fla or Triton: neither records a choice where fla's lookup reads it, and
Triton's autotuner compiles its candidates one at a time; the hooks are wrappers of ``CachedAutotuner.run`` (notices
a key added to a kernel's choices during the call) and ``CachedAutotuner._bench`` (the first timing of a key)."""

from __future__ import annotations

import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLA_CACHE = "fla.ops.utils.cache"
_kept: Path | None = None  # the run folder this process's choices go to; None: fla left as it was
_chosen: dict[str, dict[tuple, Any]] = {}  # this run's choices: kernel name -> {autotune key: triton.Config}
_compiled_ahead: set[tuple[int, tuple]] = set()  # (kernel, key) whose configs were compiled together
_compile_pool: ThreadPoolExecutor | None = None


def config_dir(run_dir: Path, rank: int) -> Path:
    """A rank's kept configs: its own folder of the run, since each rank's process autotunes on its own."""
    return run_dir / "fla-configs" / f"rank-{rank}"


def watch(directory: Path) -> bool:
    """Once the model is built, before its warm-up: record this run's autotuning choices of fla's kernels under
    ``directory`` and have fla take them for keys that differ only in numbers (fuzzy lookup); whether it did.
    Nothing off CUDA, where no fla module is loaded (the model has no gated-DeltaNet layers) or where the user set
    fla's cache variables. Each run starts from an empty record, so a sweep's next job in the same process
    autotunes for its own model."""
    global _kept
    import torch

    if FLA_CACHE not in sys.modules or not torch.cuda.is_available():
        return False
    if "FLA_CACHE_MODE" in os.environ or ("FLA_CONFIG_DIR" in os.environ and not _ours()):
        return False
    fla_cache = sys.modules[FLA_CACHE]
    _record_choices(fla_cache.CachedAutotuner)
    _compile_ahead(fla_cache.CachedAutotuner)
    _chosen.clear()
    _kept = directory
    os.environ["FLA_CONFIG_DIR"] = str(directory)
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.FUZZY  # fla read the variable at its import, before this
    fla_cache.load_config_file.cache_clear()  # an earlier run's files, read and cached by path
    log.info("fla's kernels autotune once each in this run: a row length in another band runs on the config "
             "already chosen (kept in %s)", directory)  # fmt: skip
    return True


def _ours() -> bool:
    return _kept is not None and os.environ.get("FLA_CONFIG_DIR") == str(_kept)


def _record_choices(autotuner: type) -> None:
    """Wrap ``autotuner.run`` (fla's CachedAutotuner) once per process so that a key it adds to a kernel's choices
    is written where fla's lookup reads it; a length compare per launch when nothing is added. A config taken for a
    key it was not tuned for that does not fit there (another head size, say: the errors for which Triton's own
    timing skips a config, out of resources, a compile-time assertion, ptxas) is dropped and the key autotuned, as
    without the lookup."""
    if getattr(autotuner.run, "records_choices", False):
        return
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    fla_run, triton_autotuner = autotuner.run, autotuner.__mro__[1]

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        known = len(self.cache)
        try:
            out = fla_run(self, *args, **kwargs)
        except (OutOfResources, CompileTimeAssertionFailure, PTXASError):
            if _kept is None or len(self.cache) == known:  # not a config this call took from the lookup
                raise
            self.cache.pop(_key(self, args, kwargs), None)
            out = triton_autotuner.run(self, *args, **kwargs)  # Triton's autotune alone, past fla's lookup
        if _kept is not None and len(self.cache) != known:
            record(self, args, kwargs)
        return out

    run.records_choices = True  # type: ignore[attr-defined]
    autotuner.run = run


def _compile_ahead(autotuner: type) -> None:
    """Wrap ``autotuner._bench`` once per process: a key's first timing compiles all the key's configs together."""
    if getattr(autotuner._bench, "compiles_ahead", False):
        return
    bench = autotuner._bench

    def _bench(self: Any, *args: Any, config: Any, **meta: Any) -> Any:
        ahead = (id(self), _key(self, args, meta))
        if _kept is not None and ahead not in _compiled_ahead:
            _compiled_ahead.add(ahead)
            compile_configs(self, args, meta)
        return bench(self, *args, config=config, **meta)

    _bench.compiles_ahead = True  # type: ignore[attr-defined]
    autotuner._bench = _bench


def compile_configs(kernel: Any, args: tuple, meta: dict[str, Any]) -> None:
    """The configs Triton is about to time for this call (its pruned list), compiled on the pool's threads as a
    launch with ``warmup=True`` would (same arguments, so the same compiled-kernel key); Triton's timing then finds
    them compiled. Any failure is left to the timing, which compiles the config itself and skips one that fails."""
    global _compile_pool
    try:
        from triton.runtime._async_compile import AsyncCompileMode

        if _compile_pool is None:
            threads = max(1, min(8, len(os.sched_getaffinity(0)) // 2))  # half: vLLM compiles beside the warm-up
            _compile_pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")
        launch = {name: value for name, value in meta.items() if name != "warmup"}
        with AsyncCompileMode(_compile_pool, ignore_errors=True):
            for config in kernel.prune_configs(meta):
                kernel.fn.run(*args, warmup=True, **launch, **config.all_kwargs())
    except Exception as error:  # Triton's private compile API moved, or a config's arguments did not bind
        log.debug("%s: configs not compiled ahead (%s: %s)", kernel.kernel_name, type(error).__name__, error)


def record(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """The config ``kernel`` chose (or took) for this call's key, added to the run's file of the kernel."""
    fla_cache = sys.modules[FLA_CACHE]
    key = _key(kernel, args, kwargs)
    choices = _chosen.setdefault(kernel.kernel_name, {})
    if key in choices or key not in kernel.cache or _kept is None:
        return
    choices[key] = kernel.cache[key]
    try:
        text = json.dumps(config_file(kernel.kernel_name, choices), indent=1)
    except TypeError:  # a key fla's files cannot hold: this kernel autotunes each key, as without this module
        del choices[key]
        return
    _kept.mkdir(parents=True, exist_ok=True)
    staged = _kept / f".{kernel.kernel_name}.json.tmp"
    staged.write_text(text)
    staged.replace(_kept / f"{kernel.kernel_name}.json")  # whole or absent
    fla_cache.load_config_file.cache_clear()  # fla caches a file once read: the next lookup sees this choice


def _key(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The call's autotune key as fla and Triton build it: the key's arguments, then the tensors' dtypes."""
    return sys.modules[FLA_CACHE].AutotuneKey.build(kernel.arg_names, kernel.keys, args, kwargs).autotune_key


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
