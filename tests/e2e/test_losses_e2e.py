"""One real CLI run with a non-default loss and advantage estimator (the other losses are exercised through
the real trainer step in tests/losses/test_trainer_step.py, which costs no server or worker start)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.server.process import free_port

from .helpers import CliRun, kill_marked, run_cli, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 3


@pytest.fixture(scope="module")
def cispo_run(random_tiny_model_dir: Path, arithmetic_data_dir: Path, tmp_path_factory) -> tuple[CliRun, Path]:
    run_dir = tmp_path_factory.mktemp("cispo") / "run"
    args = [
        "train", f"model.name_or_path={random_tiny_model_dir}", f"data.path={arithmetic_data_dir / 'train.jsonl'}",
        "data.eval_path=null", "reward=length", "packing.token_budget=512", f"trainer.max_steps={STEPS}",
        f"trainer.save_steps={STEPS}", "logging.console=plain", f"hydra.run.dir={run_dir}",
        f"server.port={free_port()}", "loss=cispo", "advantage=rloo", "loss.entropy_coef=0.01",
        "loss.entropy_target=100.0",
    ]  # fmt: skip
    run = run_cli(args)
    yield run, run_dir
    kill_marked(run.marker)


def test_cispo_with_rloo_trains_and_checkpoints_the_entropy_coefficient(cispo_run):
    run, run_dir = cispo_run
    assert run.returncode == 0, run.output[-3000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["cispo_clip_ratio"]) and math.isfinite(s["policy_loss"]) for s in steps)
    # the tiny model's entropy is far below a 100-nat target: the coefficient rises by delta every step
    assert [s["entropy_coef"] for s in steps] == pytest.approx([0.01, 0.015, 0.02])
    state = json.loads((run_dir / "checkpoints" / f"step_{STEPS:06d}" / "trainer_state.json").read_text())
    assert state["extra"]["loss"] == {"entropy_coef": pytest.approx(0.025)}
    assert wait_no_marked(run.marker) == []
