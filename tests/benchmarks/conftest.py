"""The benchmark scripts as modules: benchmarks/ is not a package on the tests' path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def script_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/NAME.py imported as module NAME for as long as the generator is suspended (its dataclasses look
    their module up in sys.modules); then sys.path as it was: a script that puts benchmarks/ on it (startup.py) would
    otherwise leave benchmarks/packing.py ahead of tests/packing for every later import in this worker, a spawned
    rank's included."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[name]
    sys.path[:] = path


@pytest.fixture(scope="module")
def acceptance() -> Iterator[ModuleType]:
    yield from script_module("acceptance")


@pytest.fixture(scope="module")
def vs_trl() -> Iterator[ModuleType]:
    yield from script_module("vs_trl")


@pytest.fixture(scope="module")
def e2e() -> Iterator[ModuleType]:
    yield from script_module("e2e")


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    yield from script_module("soak")


@pytest.fixture(scope="module")
def ipc_release() -> Iterator[ModuleType]:
    yield from script_module("ipc_release")


@pytest.fixture(scope="module")
def time_to_accuracy() -> Iterator[ModuleType]:
    yield from script_module("time_to_accuracy")


@pytest.fixture(scope="module")
def real_checkpoints() -> Iterator[ModuleType]:
    yield from script_module("real_checkpoints")


@pytest.fixture(scope="module")
def scoring_rate() -> Iterator[ModuleType]:
    yield from script_module("scoring_rate")


@pytest.fixture(scope="module")
def drop_rate(e2e: ModuleType, vs_trl: ModuleType) -> Iterator[ModuleType]:
    """Its imports, e2e.py and vs_trl.py, loaded first: the tests' own e2e package would stand in for the first."""
    yield from script_module("drop_rate")


@pytest.fixture(scope="module")
def save_cost() -> Iterator[ModuleType]:
    yield from script_module("save_cost")


@pytest.fixture(scope="module")
def deltanet_conv() -> Iterator[ModuleType]:
    yield from script_module("deltanet_conv")


@pytest.fixture(scope="module")
def triton_compile() -> Iterator[ModuleType]:
    yield from script_module("triton_compile")
