"""What the asset-building scripts' tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def run_twice(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[Path]]:
    """``run_twice(main, asset, args)``: a pretraining script's ``main`` run the same way into two fresh folders
    (its asset in ``<folder>/<asset>``), to compare what each wrote; the two folders."""

    def run(main: Callable[[list[str]], None], asset: str, args: list[str]) -> list[Path]:
        outs = [tmp_path_factory.mktemp(f"{asset}-run{i}") for i in range(2)]
        for out in outs:
            main(["--out", str(out / asset), *args])
        return outs

    return run
