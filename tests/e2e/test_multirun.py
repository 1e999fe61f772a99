"""`asyncrl train -m`: one run directory per job, each with its composed config, and a sweep report. The jobs
attach to the session's server one after the other (the sweep, not the launch, is under test)."""

from __future__ import annotations

import pytest
import yaml

from .helpers import run_cli, wait_no_marked

pytestmark = pytest.mark.e2e


def test_multirun_makes_one_run_dir_per_job(random_tiny_model_dir, arithmetic_data_dir, fresh_server, tmp_path):
    sweep = tmp_path / "sweep"
    run = run_cli([
        "train", "-m", "trainer.learning_rate=1e-4,3e-4", f"model.name_or_path={random_tiny_model_dir}",
        f"data.path={arithmetic_data_dir / 'train.jsonl'}", "data.eval_path=null", "reward=length",
        "trainer.max_steps=2", "trainer.save_strategy=no", "packing.token_budget=256", "logging.console=plain",
        f"hydra.sweep.dir={sweep}", "server.launch=false", f"server.base_url={fresh_server().base_url}",
    ])  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    for job, lr in (("0", 1e-4), ("1", 3e-4)):
        composed = yaml.safe_load((sweep / job / ".hydra" / "config.yaml").read_text())
        assert composed["trainer"]["learning_rate"] == lr
        assert (sweep / job / "metrics.jsonl").read_text().count("\n") == 2
    report = sweep / "report"
    assert "Reward per job" in (report / "index.html").read_text() or (report / "reward_overlay.png").is_file()
    assert wait_no_marked(run.marker) == []
