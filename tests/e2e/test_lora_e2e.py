"""The CLI with LoRA on CPU and a launched server: adapter-only syncs load each version under a new name that
rollouts then request, and the checkpoint and final model hold the adapter (merged syncs: the LoRA sweep of
test_multirun.py; resume: tests/trainer/test_lora.py). The server launched is the command plan.json holds."""

from __future__ import annotations

import re

import pytest

from asyncrl.launch import shell_line
from asyncrl.plan_file import read_plan

from .helpers import run_cli, wait_no_marked
from .test_train import common_args, steps_of

pytestmark = pytest.mark.e2e


def test_lora_run_syncs_adapters_that_rollouts_request(random_tiny_model_dir, arithmetic_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "lora=default", "lora.r=8",
            "lora.sync=adapter", "staleness.max_staleness=1", "trainer.max_steps=3",
            "trainer.save_steps=3"]  # fmt: skip
    run = run_cli(args, timeout_s=300)
    assert run.returncode == 0, run.output[-3000:]
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[-1]["model_version"] == 3
    full = (random_tiny_model_dir / "model.safetensors").stat().st_size
    assert all(0 < s["perf/weight_sync_bytes"] < full / 10 for s in steps)
    log = (run_dir / "logs" / "server.log").read_text()
    loaded = re.findall(r": loaded LoRA adapter '(asyncrl-[0-9a-f]+-v\d)'", log)
    requested = set(re.findall(r": first request under LoRA adapter '(asyncrl-[0-9a-f]+-v\d)'", log))
    assert [name[-2:] for name in loaded] == ["v1", "v2", "v3"] and requested & set(loaded[:2])
    assert requested <= set(loaded)
    assert not (run_dir / ".vllm_lora").exists()  # the serving cache goes with the run; the adapter is saved:
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    assert wait_no_marked(run.marker) == []
    plan = read_plan(run_dir)  # the launcher decided the command before starting the server, and launched it
    assert plan.server_commands is not None and len(plan.server_commands) == 1
    command = plan.server_commands[0]
    assert shell_line(command.argv, command.env) == (run_dir / "commands" / "server.sh").read_text()
    assert command.backend == "builtin" and "--enable-lora" in command.argv  # its adapter slots
    assert command.argv[command.argv.index("--weights-dir") + 1] == plan.config.server.weights_dir
