"""The warm-up's autotuned fla configs, kept for the row lengths it did not see (trainer/autotune.py). fla's kernels
autotune only on a GPU, so here one of its kernels is given the choice an autotune of the warm-up's row would make
(its key as Triton builds it: the key's arguments, then the tensors' dtypes), and fla's own lookup, the one its
kernels make before autotuning a key, must hand that choice to another row-length band."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.trainer.autotune import config_dir, forget, keep

WARM_UP_KEY = (128, 4, "torch.bfloat16", "torch.bfloat16", "torch.float32")  # D, NB (16,384 tokens x 16 heads)
SHORTER_ROW = (128, 2, "torch.bfloat16", "torch.bfloat16", "torch.float32")  # a row of 4,097-8,192 tokens


@pytest.fixture
def fla_cache(monkeypatch):
    """fla's config cache module, its lookup mode and variables put back after the test."""
    cache = pytest.importorskip("fla.ops.utils.cache", reason="needs fla-core (and Triton) installed")
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FLA_CACHE_MODE)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    return cache


def test_a_band_the_warm_up_did_not_see_runs_on_its_choice_without_autotuning(fla_cache, tmp_path, monkeypatch):
    import triton
    from fla.modules.norm import l2norm

    kernel = l2norm.l2norm_fwd_kernel
    chosen = triton.Config({"BT": 32}, num_warps=8, num_stages=2)
    monkeypatch.setattr(kernel, "cache", {WARM_UP_KEY: chosen})
    directory = config_dir(tmp_path, 0)
    assert keep(directory) >= 1
    written = json.loads((directory / "l2norm_fwd_kernel.json").read_text())
    assert [entry["autotune_key"] for entry in written["autotune_entries"].values()] == [list(WARM_UP_KEY)]
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.FUZZY
    kernel.maybe_load_cached_config(key=fla_cache.AutotuneKey(SHORTER_ROW), nargs={}, runtime_kwargs={})
    taken = kernel.cache[SHORTER_ROW]  # set here, so Triton's run finds the key and does not autotune it
    assert (taken.kwargs, taken.num_warps, taken.num_stages) == ({"BT": 32}, 8, 2)
    assert list(directory.iterdir()) == [directory / "l2norm_fwd_kernel.json"]  # no staged file left


def test_the_next_run_in_the_process_autotunes_its_own_model_and_may_keep_anew(fla_cache, tmp_path, monkeypatch):
    """A sweep's jobs run in one process: the next job's warm-up must not take the last model's choices."""
    import triton
    from fla.modules.norm import l2norm

    monkeypatch.setattr(l2norm.l2norm_fwd_kernel, "cache", {WARM_UP_KEY: triton.Config({"BT": 16})})
    assert keep(config_dir(tmp_path / "job0", 0)) >= 1
    forget()
    assert "FLA_CONFIG_DIR" not in os.environ and fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.DISABLED
    assert keep(config_dir(tmp_path / "job1", 0)) >= 1  # its own folder, not refused as a user's setting
    assert os.environ["FLA_CONFIG_DIR"] == str(config_dir(tmp_path / "job1", 0))
    forget()
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "mine"))
    forget()  # a user's folder stays
    assert os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "mine")


def test_a_users_own_fla_cache_setting_is_left_alone(fla_cache, tmp_path, monkeypatch):
    import triton
    from fla.modules.norm import l2norm

    monkeypatch.setattr(l2norm.l2norm_fwd_kernel, "cache", {WARM_UP_KEY: triton.Config({"BT": 8})})
    monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    assert keep(tmp_path / "kept") == 0
    assert not (tmp_path / "kept").exists() and fla_cache.FLA_CACHE_MODE is not fla_cache.FlaCacheMode.FUZZY


def test_without_a_tuned_kernel_nothing_is_written(tmp_path):
    """Where fla is not installed (as on the CPU) or nothing of it autotuned, the warm-up leaves no folder."""
    assert keep(config_dir(tmp_path, 1)) == 0
    assert not (tmp_path / "fla-configs").exists()
