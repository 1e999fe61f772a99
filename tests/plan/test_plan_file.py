"""plan.json: the plan round-trips through its file and the schema refuses what is not a plan; in a real two-rank
run the launcher alone plans and every other process reads the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.config.compose import compose
from asyncrl.metrics import read_jsonl
from asyncrl.plan.assemble import plan_run
from asyncrl.plan.plan_file import (
    PLAN_FILE,
    PlanFileError,
    plan_from_record,
    plan_record,
    read_plan,
    write_plan,
)
from asyncrl.serving.process import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "overrides",
    [[], ["lora=default", "lora.sync=auto", "staleness.max_staleness=0", "trainer.samples_per_step=16"],
     ["server=vllm", "server.max_model_len=512", "model.dtype=float32"]],
    ids=["default", "lora-synchronous", "vllm"],
)  # fmt: skip
def test_a_plan_round_trips_through_its_json(overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # where a job places a launched vLLM and its trainer
    plan = plan_run(compose(overrides), tmp_path)  # a job's plan: its directories and private weights dir decided
    assert (plan.gpu_split is not None) == ("server=vllm" in overrides)
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
     (lambda r: r["config"]["trainer"].update(max_step=3), "max_step")],
    ids=["version", "unknown", "missing", "int", "enum", "optional-bool", "flow", "config"],
)  # fmt: skip
def test_a_record_that_is_not_a_plan_is_refused_naming_the_key(change, named):
    record = json.loads(json.dumps(plan_record(plan_run(compose([])))))
    change(record)
    with pytest.raises(PlanFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan_from_record(record)


def test_a_directory_without_a_plan_says_where_plans_come_from(tmp_path):
    with pytest.raises(PlanFileError, match="no plan"):
        read_plan(tmp_path)


RECORDER = '''
"""Loaded by every Python process of the test's run: appends "pid argv" to $PLAN_CALLS at each planning call."""
import importlib.machinery
import os
import sys


class PlanCalls:
    def find_spec(self, name, path, target=None):
        if name != "asyncrl.plan.assemble":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for function in ("plan_run", "build_plan"):
                setattr(module, function, recorded(getattr(module, function)))

        spec.loader.exec_module = exec_module
        return spec


def recorded(function):
    def call(*args, **kwargs):
        with open(os.environ["PLAN_CALLS"], "a") as log:
            log.write(f"{os.getpid()} {function.__name__} {' '.join(sys.argv)}\\n")
        return function(*args, **kwargs)

    return call


sys.meta_path.insert(0, PlanCalls())
'''


@pytest.mark.e2e
@pytest.mark.long
def test_in_a_two_rank_run_only_the_launcher_plans(random_tiny_model_dir, arithmetic_data_dir, tmp_path):
    """The CLI plans and writes plan.json; the ranks' launcher, both ranks, the rollout worker and the server plan
    nothing (a recorder loaded into every Python process of the run logs each planning call with its pid)."""
    hooks, calls, run_dir = tmp_path / "hooks", tmp_path / "plan_calls.log", tmp_path / "run"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(RECORDER))
    args = [
        "train", f"model.name_or_path={random_tiny_model_dir}", f"data.path={arithmetic_data_dir / 'train.jsonl'}",
        "data.eval_path=null", "reward=length", "packing.token_budget=512", "trainer.max_steps=1",
        "trainer.num_processes=2", "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}",
        f"server.port={free_port()}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{REPO}", "PLAN_CALLS": str(calls), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()  # the run's children end with it (die-with-parent)
    assert proc.returncode == 0, output[-3000:]
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1]
    assert (run_dir / "logs" / "rank_1.log").is_file()  # the second rank ran
    planners = {line.split()[0] for line in calls.read_text().splitlines()}
    assert planners == {str(proc.pid)}, calls.read_text()
    assert read_plan(run_dir).world_size == 2 and (run_dir / PLAN_FILE).is_file()
