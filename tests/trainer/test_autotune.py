"""fla's kernels autotune once each per run (trainer/autotune.py). fla's kernels autotune only on a GPU, so the CPU
tests stand in for Triton's benchmark alone (``Autotuner.run``: a key not chosen yet is counted and given one of the
kernel's configs); fla's own code around it runs as it is: its key, its config files' lookup, its fuzzy match. The
GPU test runs the real kernel."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asyncrl.trainer import autotune
from asyncrl.trainer.autotune import config_dir, watch

D = 128  # l2norm_fwd_kernel's key is (D, NB), then the tensors' dtypes; NB = ceil(rows / 65536)


@pytest.fixture
def fla(monkeypatch):
    """fla's config cache module; its lookup mode, variables and autotuner class put back after the test, and
    CUDA said to be there (``watch`` acts only on CUDA)."""
    cache = pytest.importorskip("fla.ops.utils.cache", reason="needs fla-core (and Triton) installed")
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FLA_CACHE_MODE)
    monkeypatch.setattr(cache.CachedAutotuner, "run", cache.CachedAutotuner.run)
    monkeypatch.setattr(cache.CachedAutotuner, "_bench", cache.CachedAutotuner._bench)
    monkeypatch.setattr(autotune, "_kept", None)
    monkeypatch.setattr(autotune, "_compiled_ahead", set())
    for name in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):  # set first, so that the test's own setting is undone too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return cache


@pytest.fixture
def benchmarked(fla, monkeypatch):
    """The keys Triton's autotune benchmarked (each given the kernel's fourth config); no kernel launches."""
    from triton.runtime.autotuner import Autotuner

    keys = []

    def run(self, *args, **kwargs):
        key = fla.AutotuneKey.build(self.arg_names, self.keys, args, kwargs).autotune_key
        if key not in self.cache:
            keys.append(key)
            self.cache[key] = self.configs[3]

    monkeypatch.setattr(Autotuner, "run", run)
    return keys


@pytest.fixture
def kernel(fla, monkeypatch):
    from fla.modules.norm import l2norm

    monkeypatch.setattr(l2norm.l2norm_fwd_kernel, "cache", {})
    return l2norm.l2norm_fwd_kernel


def launch(kernel, tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """One call as l2norm_fwd makes it, on ``tokens`` rows; the key it has."""
    x = torch.zeros(1, D, dtype=dtype)
    rstd = torch.zeros(1, dtype=torch.float32)
    nb = -(-tokens // 65536)
    kernel.run(x=x, y=x, rstd=rstd, eps=1e-6, T=tokens, D=D, BD=D, NB=nb, grid=(1,), warmup=False)
    return (D, nb, str(dtype), str(dtype), "torch.float32")


def test_a_kernel_autotunes_once_and_other_row_bands_run_on_its_choice(fla, benchmarked, kernel, tmp_path):
    directory = config_dir(tmp_path, 0)
    assert watch(directory)
    long_row = launch(kernel, 16384 * 16)  # the warm-up's row: NB 4
    assert benchmarked == [long_row]
    written = json.loads((directory / "l2norm_fwd_kernel.json").read_text())
    assert [entry["autotune_key"] for entry in written["autotune_entries"].values()] == [list(long_row)]
    short_row = launch(kernel, 2000 * 16)  # the warm-up's short row, or a real step's row in another band: NB 1
    assert benchmarked == [long_row]  # fla's lookup took the recorded choice: no benchmark
    assert kernel.cache[short_row].all_kwargs() == kernel.cache[long_row].all_kwargs()
    assert fla.FLA_CACHE_MODE is fla.FlaCacheMode.FUZZY and os.environ["FLA_CONFIG_DIR"] == str(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["l2norm_fwd_kernel.json"]  # no staged file left


def test_a_key_that_differs_in_more_than_sizes_still_autotunes(benchmarked, kernel, tmp_path):
    assert watch(config_dir(tmp_path, 0))
    launch(kernel, 16384 * 16)
    launch(kernel, 16384 * 16, torch.float32)
    launch(kernel, 4096 * 16, torch.float32)  # a band of the float32 key: runs on that one's choice
    assert [key[2] for key in benchmarked] == ["torch.bfloat16", "torch.float32"]


def does_not_fit(kind: str) -> Exception:
    """The errors for which Triton's timing skips a config: too much shared memory, a compile-time assertion, ptxas."""
    import ast

    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    made = {"resources": lambda: OutOfResources(232448, 227 * 1024, "shared memory"),
            "assertion": lambda: CompileTimeAssertionFailure(None, ast.parse("BD >= D").body[0], "BD >= D"),
            "ptxas": lambda: PTXASError("ptxas: too many registers")}  # fmt: skip
    return made[kind]()


@pytest.mark.parametrize("error", ["resources", "assertion", "ptxas"])
def test_a_taken_config_that_does_not_fit_another_head_size_is_autotuned_there(fla, kernel, tmp_path, monkeypatch,
                                                                               error):  # fmt: skip
    """fla's fuzzy lookup ignores every number of a key, head sizes too: a config that does not fit at the other size
    (at its launch: out of resources, a compile-time assertion, ptxas) is dropped and that key autotuned instead of
    failing."""
    from triton.runtime.autotuner import Autotuner

    benchmarked = []

    def run(self, *args, **kwargs):  # configs from the fourth on do not fit at D 256
        key = fla.AutotuneKey.build(self.arg_names, self.keys, args, kwargs).autotune_key
        fits = [c for i, c in enumerate(self.configs) if key[0] < 256 or i < 3]
        if key not in self.cache:
            benchmarked.append(key)
            self.cache[key] = fits[-1]
        if self.cache[key] not in fits:
            raise does_not_fit(error)

    monkeypatch.setattr(Autotuner, "run", run)
    assert watch(config_dir(tmp_path, 0))
    small = launch(kernel, 16384 * 16)
    assert kernel.cache[small] is kernel.configs[-1]
    large = (256, *small[1:])
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    kernel.run(x=x, y=x, rstd=torch.zeros(1), eps=1e-6, T=16, D=256, BD=256, NB=4, grid=(1,), warmup=False)
    assert benchmarked == [small, large] and kernel.cache[large] is kernel.configs[2]
    written = json.loads((config_dir(tmp_path, 0) / "l2norm_fwd_kernel.json").read_text())
    assert len(written["autotune_entries"]) == 2


class JitStandIn:
    """Triton's JIT function under an autotuner, which compiles only where a GPU driver is: records the launches."""

    def __init__(self, fails: bool = False) -> None:
        self.launches: list[tuple[bool, int, int]] = []
        self.fails = fails

    def run(self, *args, grid, warmup, **kwargs):
        if self.fails:
            raise RuntimeError("0 active drivers")
        self.launches.append((warmup, kwargs["BT"], kwargs["num_warps"]))


def time_configs(kernel, tokens: int, configs) -> None:
    """What Triton's autotune does for a key it has not chosen: set its arguments, then time each config."""
    x = torch.zeros(1, D, dtype=torch.bfloat16)
    meta = {"eps": 1e-6, "T": tokens, "D": D, "BD": D, "NB": -(-tokens // 65536), "grid": (1,), "warmup": False}
    kernel.nargs = {"x": x, "y": x, "rstd": torch.zeros(1)}
    for config in configs:
        kernel._bench(x, x, torch.zeros(1), config=config, **meta)


def test_a_keys_first_timing_compiles_all_its_configs_first(fla, kernel, tmp_path, monkeypatch):
    timed = []
    monkeypatch.setattr(fla.CachedAutotuner, "_bench", lambda self, *a, config, **m: timed.append(config))
    jit = JitStandIn()
    monkeypatch.setattr(kernel, "fn", jit)
    assert watch(config_dir(tmp_path, 0))
    time_configs(kernel, 16384 * 16, kernel.configs)
    compiled = [(True, c.kwargs["BT"], c.num_warps) for c in kernel.configs]
    assert jit.launches == compiled and timed == kernel.configs  # every config compiled once, before the first timing
    time_configs(kernel, 2000 * 16, kernel.configs[:2])  # another key: its configs compiled once too
    assert len(jit.launches) == 2 * len(compiled)


def test_a_failed_compile_ahead_leaves_the_timing_to_compile(fla, kernel, tmp_path, monkeypatch):
    timed = []
    monkeypatch.setattr(fla.CachedAutotuner, "_bench", lambda self, *a, config, **m: timed.append(config))
    monkeypatch.setattr(kernel, "fn", JitStandIn(fails=True))
    assert watch(config_dir(tmp_path, 0))
    time_configs(kernel, 16384 * 16, kernel.configs)
    assert timed == kernel.configs


def test_the_next_run_in_the_process_autotunes_its_own_model(fla, benchmarked, kernel, tmp_path):
    """A sweep's jobs run in one process: the next job's kernels must not take the last model's choices."""
    assert watch(config_dir(tmp_path / "job0", 0))
    launch(kernel, 16384 * 16)
    assert watch(config_dir(tmp_path / "job1", 0))  # its own folder, not refused as a user's setting
    assert os.environ["FLA_CONFIG_DIR"] == str(config_dir(tmp_path / "job1", 0))
    launch(kernel, 2000 * 16)
    assert len(benchmarked) == 2
    assert len(json.loads((config_dir(tmp_path / "job1", 0) / "l2norm_fwd_kernel.json").read_text())[
        "autotune_entries"]) == 1  # fmt: skip


def test_a_users_own_fla_cache_setting_is_left_alone(fla, benchmarked, kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "mine"))
    assert not watch(tmp_path / "kept")
    launch(kernel, 16384 * 16)
    assert not (tmp_path / "kept").exists() and fla.FLA_CACHE_MODE is not fla.FlaCacheMode.FUZZY
    assert os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "mine")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's case")
def test_off_cuda_fla_is_left_as_it_was(tmp_path):
    """On the CPU (fla's kernels do not run) nothing is set and no folder is made, fla installed or not."""
    assert not watch(config_dir(tmp_path, 1))
    assert not (tmp_path / "fla-configs").exists() and "FLA_CONFIG_DIR" not in os.environ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_second_band_does_not_benchmark(kernel, tmp_path, monkeypatch, caplog):
    from fla.modules.norm.l2norm import l2norm_fwd

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # no earlier run's autotune on disk
    assert watch(config_dir(tmp_path, 0))
    x = torch.randn(16384, 16, D, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("DEBUG", logger="asyncrl.trainer.autotune"):
        y, _ = l2norm_fwd(x)
    assert "not compiled ahead" not in caplog.text  # its 25 configs compiled on the pool, then timed
    timings = kernel.configs_timings  # set by the benchmark
    y_short, _ = l2norm_fwd(x[:2000])
    assert kernel.configs_timings is timings and len(kernel.cache) == 2
    torch.testing.assert_close(y_short, y[:2000])
