"""The CLI surface: version, recipes, config printing, --cfg job, and bad input failing before work starts."""

from __future__ import annotations

import importlib.util
import logging

import pytest
from typer.testing import CliRunner

from asyncrl import __version__
from asyncrl.cli import app
from asyncrl.serving.process import free_port
from asyncrl.serving.vllm import install_command

runner = CliRunner()
without_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_recipes_table_lists_deepmath_with_its_description():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0
    assert "deepmath" in result.output and "DeepMath-103K" in result.output


def test_config_prints_composed_yaml_with_overrides():
    result = runner.invoke(app, ["config", "+recipe=deepmath", "sampling.temperature=0.7"])
    assert result.exit_code == 0, result.output
    assert "name_or_path: Qwen/Qwen3.5-2B" in result.output
    assert "temperature: 0.7" in result.output


def test_config_error_is_one_line_and_exit_code_2():
    result = runner.invoke(app, ["config", "sampling.top_p=0.9"])
    assert result.exit_code == 2
    assert "sampling.top_p=0.9 needs sampling.top_k > 0" in result.output


def test_config_run_dir_prints_what_that_run_decided_from_its_plan(tmp_path):
    import json

    from asyncrl.config.compose import compose
    from asyncrl.plan.assemble import plan_run
    from asyncrl.plan_file import write_plan

    write_plan(plan_run(compose(["server=builtin", "sampling.temperature=0.7"]), tmp_path), tmp_path)
    printed = runner.invoke(app, ["config", "--run-dir", str(tmp_path)])
    assert printed.exit_code == 0 and "temperature: 0.7" in printed.output
    plan = runner.invoke(app, ["config", "--plan", "--run-dir", str(tmp_path)])
    assert json.loads(plan.output)["server_backend"] == "builtin"
    commands = runner.invoke(app, ["config", "--server-command", "--run-dir", str(tmp_path)])
    assert commands.exit_code == 0 and "asyncrl.engine" in commands.output
    with_overrides = runner.invoke(app, ["config", "--run-dir", str(tmp_path), "sampling.temperature=1.0"])
    assert with_overrides.exit_code == 2 and "drop the overrides" in with_overrides.output
    missing = runner.invoke(app, ["config", "--run-dir", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "no plan" in missing.output


def test_a_sweep_value_that_cannot_compose_fails_in_one_line_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    result = runner.invoke(app, ["train", "-m", "trainer.lr_scheduler_type=cosine,cosinee", "trainer.seed=1,2",
                                 f"hydra.sweep.dir={sweep}"])  # fmt: skip
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "config error: trainer.lr_scheduler_type: Invalid value 'cosinee', expected one of [constant, "
        "constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial, inverse_sqrt, cosine_with_min_lr, "
        "cosine_warmup_with_min_lr, warmup_stable_decay]"
    ]
    assert not sweep.exists()


def test_a_sweep_into_a_sweep_that_trained_is_refused_before_hydra_writes_there(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "1").mkdir(parents=True)
    (sweep / "1" / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.relative_to(sweep) for p in sweep.rglob("*"))
    result = runner.invoke(app, ["train", "-m", "trainer.seed=1,2", f"hydra.sweep.dir={sweep}"])
    assert result.exit_code == 2 and f"{sweep / '1'} already holds a run" in result.output
    assert sorted(p.relative_to(sweep) for p in sweep.rglob("*")) == before  # no multirun.yaml, no job 0


def test_train_cfg_job_prints_and_exits_without_training(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["train", "--cfg", "job", "trainer.max_steps=7"])
    assert result.exit_code == 0, result.output
    assert "max_steps: 7" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_train_rejects_bad_config_before_starting_anything(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["train", "staleness.max_staleness=-1"])
    assert result.exit_code == 2
    assert "staleness.max_staleness=-1" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_train_rejects_a_dataset_without_prompts_before_the_server_starts(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "solution": "2"}\n')
    result = invoke(["train", f"data.path={data}", f"hydra.run.dir={tmp_path / 'run'}", f"server.port={free_port()}"])
    assert result.exit_code == 2
    assert "has no 'prompt' column (columns: question, solution)" in result.output
    assert not (tmp_path / "run").exists()  # the directory Hydra made for the job went with it
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    assert not [h.baseFilename for h in handlers if str(tmp_path) in h.baseFilename]  # and its log file's handler


def test_config_shows_the_server_command_without_running_it():
    result = runner.invoke(app, ["config", "--server-command", "server.port=8123"])
    assert result.exit_code == 0, result.output
    assert "-m asyncrl.engine" in result.output and "--port 8123" in result.output


def test_config_shows_a_command_per_replica():
    result = runner.invoke(app, ["config", "--server-command", "server.port=8123", "server.replicas=2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 and "--port 8123" in lines[0] and "--port 8124" in lines[1]


def test_the_vllm_command_is_printed_without_gpus_here_with_a_warning(monkeypatch):
    """A login node preparing a cluster job: no GPU visible, vLLM not installed (its version given)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = runner.invoke(app, ["config", "--server-command", "+recipe=deepmath", "server.vllm_version=0.26.0",
                                 "server.max_model_len=4096"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "0 GPU(s) visible here, 2 needed: the command is for a machine whose CUDA_VISIBLE_DEVICES=0,1" \
        in result.output  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES=0 " in result.output  # the server's GPU of the two
    assert "vllm.entrypoints.cli.main serve Qwen/Qwen3.5-2B" in result.output


def test_the_printed_vllm_command_quantizes_and_the_builtin_server_refuses_in_one_line(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = runner.invoke(app, ["config", "--server-command", "server=vllm", "server.vllm_version=0.33.0",
                                 "server.max_model_len=512", "server.quantization=fp8"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert " --quantization fp8 " in result.stdout and "--worker-extension-cls" not in result.stdout
    refused = runner.invoke(app, ["config", "--server-command", "server=builtin", "server.quantization=fp8"])
    assert refused.exit_code == 2 and refused.output.strip().splitlines() == [
        "config error: server.quantization=fp8 is vLLM's: the built-in server cannot quantize; set server=vllm, or "
        "drop server.quantization"
    ]


@without_vllm
def test_the_quick_start_vllm_command_is_printed_without_vllm_a_gpu_or_the_hub(monkeypatch):
    """The recipe and no other key, with HF_HUB_OFFLINE=1 (conftest): the newest verified release, the prompt length
    at its stated default, and what the unreadable checkpoint would have decided, each said on stderr."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = runner.invoke(app, ["config", "--server-command", "+recipe=deepmath"])
    assert result.exit_code == 0, result.output
    assert "vllm.entrypoints.cli.main serve Qwen/Qwen3.5-2B" in result.stdout
    assert "--dtype bfloat16 --max-model-len 2560 " in result.stdout  # 512 + the recipe's 2048 completion tokens
    warnings = result.stderr.splitlines()
    assert all(line.startswith("warning: ") for line in warnings) and len(warnings) == 4, result.stderr
    assert "the command is for vLLM 0.33.0, the newest release asyncrl has verified" in warnings[0]
    assert warnings[1].startswith("warning: model.name_or_path=Qwen/Qwen3.5-2B: its config.json cannot be read here "
                                  "(HF_HUB_OFFLINE=1), so the command lacks what the checkpoint would decide: "
                                  "--limit-mm-per-prompt (a vision-language checkpoint)")  # fmt: skip
    assert "--max-model-len assumes prompts of up to 512 tokens, a default (set data.max_prompt_length=N" in warnings[2]
    assert "0 GPU(s) visible here, 2 needed: the command is for a machine whose CUDA_VISIBLE_DEVICES=0,1" in warnings[3]


@without_vllm
def test_train_on_vllm_without_vllm_fails_in_one_line_before_the_run_starts(invoke, tmp_path):
    result = invoke(["train", "server=vllm", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        f"config error: server.backend=vllm but vllm is not installed here: install it ({install_command()}), "
        "or serve with the built-in server (server=builtin)"
    ]
    assert not (tmp_path / "run").exists()


def test_help_says_what_each_command_takes_and_shows_no_type_for_a_flag():
    for command in ([], ["train"], ["serve"], ["export"]):
        assert "<bool>" not in runner.invoke(app, [*command, "--help"]).output
    assert "serve [OPTIONS] [RUN_DIR] [OVERRIDES]..." in runner.invoke(app, ["serve", "--help"]).output
    assert "train [OPTIONS] [OVERRIDES]..." in runner.invoke(app, ["train", "--help"]).output
