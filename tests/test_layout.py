"""The repository's layout: a run started anywhere in the checkout (the README's own-task walk-through runs in
examples/own_task) leaves nothing for git to list, and no tracked file is ignored."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not (REPO / ".git").exists() or not shutil.which("git"), reason="not a git checkout")


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("run_dir", ["runs/2026-01-01_00-00-00", "runs/multirun/2026-01-01_00-00-00/0",
                                     "outputs/2026-01-01/00-00-00", "multirun/2026-01-01/00-00-00"])  # fmt: skip
def test_run_directories_are_ignored_wherever_a_run_starts(run_dir: str) -> None:
    for where in ("", "examples/own_task/"):
        assert git("check-ignore", "-q", f"{where}{run_dir}/config.yaml").returncode == 0, f"{where}{run_dir}"


def test_no_tracked_file_is_ignored() -> None:
    assert git("ls-files", "--cached", "--ignored", "--exclude-standard").stdout == ""
