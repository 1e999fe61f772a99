"""Lint and formatting are part of the suite: ruff (pinned in the test extra, so every machine formats alike) checks
and formats the package, the tests and the benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATHS = ["asyncrl", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(command: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff {' '.join(command)} (fix: ruff {command[0]} {' '.join(PATHS)}):\n" + (
        proc.stdout[-4000:] + proc.stderr[-2000:]
    )
