"""plan.json: the plan round-trips through its file and the schema refuses what is not a plan. That in a real
two-rank run the CLI alone plans and every other process (the ranks' launcher, the ranks, the rollout worker, the
servers, a second node) reads the file is checked on tests/e2e/test_multigpu.py's runs, which record every planning
call of every process."""

from __future__ import annotations

import json

import pytest

from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.plan_file import (
    PlanFileError,
    plan_from_record,
    plan_record,
    read_plan,
    write_plan,
)


@pytest.mark.parametrize(
    "overrides",
    [[], ["lora=default", "lora.sync=auto", "staleness.max_staleness=0", "trainer.samples_per_step=16"],
     ["server=vllm", "server.max_model_len=512", "server.vllm_version=0.33.0", "model.dtype=float32"]],
    ids=["default", "lora-synchronous", "vllm"],
)  # fmt: skip
def test_a_plan_round_trips_through_its_json(overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # where a job places a launched vLLM and its trainer
    plan = plan_run(compose(overrides), tmp_path)  # a job's plan: its directories and private weights dir decided
    assert (plan.gpu_split is not None) == ("server=vllm" in overrides)
    assert plan.server_commands is not None and plan.server_commands[0].env  # the launched server's, decided
    again = plan_from_record(json.loads(json.dumps(plan_record(plan))))
    assert again == plan and again.components is not plan.components  # each process builds its own
    assert again.flow.batch_groups == plan.flow.batch_groups


def test_write_plan_replaces_the_file_whole_and_read_plan_returns_it(tmp_path):
    first, second = plan_run(compose([]), tmp_path), plan_run(compose(["trainer.max_steps=7"]), tmp_path)
    write_plan(first, tmp_path)
    write_plan(second, tmp_path)
    assert read_plan(tmp_path) == second
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left


@pytest.mark.parametrize(
    ("change", "named"),
    [(lambda r: r.update(version=0), "version 0"),
     (lambda r: r.update(extra=1), "unknown keys ['extra']"),
     (lambda r: r.pop("world_size"), "missing keys ['world_size']"),
     (lambda r: r.update(world_size="2"), "world_size='2'"),
     (lambda r: r.update(serving_dtype="float8"), "serving_dtype='float8'"),
     (lambda r: r.update(adapter_sync="no"), "adapter_sync='no'"),
     (lambda r: r["flow"].update(max_stalenes=2), "flow"),
     (lambda r: r.update(server_commands=[{"backend": "builtin", "argv": [], "env": {"OMP_NUM_THREADS": 1}}]),
      "server_commands[0].env.OMP_NUM_THREADS=1"),
     (lambda r: r["config"]["trainer"].update(max_step=3), "max_step")],
    ids=["version", "unknown", "missing", "int", "enum", "optional-bool", "flow", "command-env", "config"],
)  # fmt: skip
def test_a_record_that_is_not_a_plan_is_refused_naming_the_key(change, named):
    record = json.loads(json.dumps(plan_record(plan_run(compose([])))))
    change(record)
    with pytest.raises(PlanFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan_from_record(record)


def test_a_directory_without_a_plan_says_where_plans_come_from(tmp_path):
    with pytest.raises(PlanFileError, match="no plan"):
        read_plan(tmp_path)
