"""The repository's layout: tests/ mirrors the package (tests/<pkg>/ holds the tests of asyncrl/<pkg>/), a run started
anywhere in the checkout (the README's own-task walk-through runs in examples/own_task) leaves nothing for git to
list, and no tracked file is ignored."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

NOT_PACKAGES = {
    "e2e": "runs of the real CLI end to end, through every package at once",
    "benchmarks": "tests of the scripts in benchmarks/, which are not part of asyncrl",
}
"""Test folders that mirror no package of asyncrl, each with why."""

needs_git = pytest.mark.skipif(not (REPO / ".git").exists() or not shutil.which("git"), reason="not a git checkout")


def test_each_test_folder_mirrors_a_package() -> None:
    """Each folder holding test files is a package's (tests/weights/ -> asyncrl/weights/), or named in NOT_PACKAGES."""
    folders = {path.parent.relative_to(TESTS) for path in TESTS.rglob("test_*.py")} - {Path()}
    mirrored = {f for f in folders if any((REPO / "asyncrl" / f).glob("*.py")) or f.parts[0] in NOT_PACKAGES}
    assert folders == mirrored, f"test folders with no asyncrl package of that name: {sorted(folders - mirrored)}"
    assert all((TESTS / name).is_dir() for name in NOT_PACKAGES)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("run_dir", ["runs/2026-01-01_00-00-00", "runs/multirun/2026-01-01_00-00-00/0",
                                     "outputs/2026-01-01/00-00-00", "multirun/2026-01-01/00-00-00"])  # fmt: skip
@needs_git
def test_run_directories_are_ignored_wherever_a_run_starts(run_dir: str) -> None:
    for where in ("", "examples/own_task/"):
        assert git("check-ignore", "-q", f"{where}{run_dir}/config.yaml").returncode == 0, f"{where}{run_dir}"


@needs_git
def test_no_tracked_file_is_ignored() -> None:
    assert git("ls-files", "--cached", "--ignored", "--exclude-standard").stdout == ""
