"""The name a server serves its model under (a Hub id as it is, a local directory by a short name), and what the
built-in server's command takes of server.model_impl."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError
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


def test_the_builtin_server_runs_transformers_code_and_refuses_vllms_implementation(monkeypatch):
    """It is transformers' implementation already: auto and transformers change nothing in its command; vllm is
    refused in one line naming the key, when composed with server=builtin and when server=auto resolves to it."""
    default = builtin_command(plan_run(compose(["server=builtin"]))).argv
    assert builtin_command(plan_run(compose(["server=builtin", "server.model_impl=transformers"]))).argv == default
    message = r"^server.model_impl=vllm asks for vLLM's implementation of the model, and the built-in server runs"
    with pytest.raises(ConfigError, match=message):
        plan_run(compose(["server=builtin", "server.model_impl=vllm"]))
    monkeypatch.setattr("asyncrl.plan.assemble.resolve_backend", lambda config: "builtin")  # a GPU machine too
    auto = plan_run(compose(["server=auto", "server.model_impl=vllm"]))
    assert auto.server_backend == "builtin"
    with pytest.raises(ConfigError, match=message) as refused:
        builtin_command(auto)
    assert "\n" not in str(refused.value)
