"""benchmarks/triton_compile.py: its signature and constants are those fla's l2norm_fwd_kernel takes, so a config
compiles for the GPU target on this machine (no GPU needed) and the benchmark times real compiles."""

from __future__ import annotations

from types import ModuleType

import pytest


def test_a_config_of_the_kernel_compiles_for_the_gpu_target(triton_compile: ModuleType, tmp_path, monkeypatch) -> None:
    l2norm = pytest.importorskip("fla.modules.norm.l2norm", reason="needs fla-core (and Triton) installed")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    triton_compile.compile_config(l2norm.l2norm_fwd_kernel.configs[0], 90)
    assert [path.name for path in tmp_path.rglob("*.cubin")] == ["l2norm_fwd_kernel.cubin"]
