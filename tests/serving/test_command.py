"""The name a server serves its model under (a Hub id as it is, a local directory by a short name), and what the
built-in server's command takes of server.model_impl."""

from __future__ import annotations

from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.serving.command import builtin_command, served_name


def test_a_local_model_is_served_by_its_name_not_its_path(tmp_path):
    for directory in ("tiny-arith", "runs/2026-01-31_12-00-00/model", "runs/b/checkpoints/step_000060"):
        (tmp_path / directory).mkdir(parents=True)
    assert served_name("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert served_name(str(tmp_path / "tiny-arith")) == "tiny-arith"
    assert served_name(str(tmp_path / "runs/2026-01-31_12-00-00/model")) == "2026-01-31_12-00-00/model"
    assert served_name(str(tmp_path / "runs/b/checkpoints/step_000060")) == "b/step_000060"


def test_the_builtin_server_runs_transformers_code_whatever_model_impl_allows():
    """It is transformers' implementation already: auto and transformers change nothing in its command (vllm is
    refused as the run plans: tests/plan/test_assemble.py)."""
    default = builtin_command(plan_run(compose(["server=builtin"]))).argv
    assert builtin_command(plan_run(compose(["server=builtin", "server.model_impl=transformers"]))).argv == default
