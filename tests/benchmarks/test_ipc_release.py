"""benchmarks/ipc_release.py where CUDA IPC cannot run: it refuses in one line, the handle fields it reads to
release a dead consumer's count are the ones torch's rebuild takes, and its vLLM loads in place through asyncrl's
worker extension as a run's does."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from .conftest import REPO


def test_the_reference_counter_fields_are_torchs(ipc_release: ModuleType) -> None:
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)[ipc_release.REF_COUNTER_ARGS]
    assert names == ["ref_counter_handle", "ref_counter_offset"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_without_a_gpu_it_refuses_in_one_line() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ipc_release.py")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and done.stderr.strip() == "ipc_release: needs a CUDA GPU (CUDA IPC)"


def test_its_vllm_loads_in_place_as_a_runs_does(ipc_release: ModuleType, tmp_path: Path, monkeypatch) -> None:
    from asyncrl.serving.vllm import vllm_command

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the GPU the job's plan places server and trainer on
    monkeypatch.setattr("asyncrl.serving.vllm.installed_vllm_version", lambda: "0.33.0")  # as where it runs
    plan = ipc_release.tiny_plan(tmp_path)
    command = vllm_command(plan, version="0.33.0")
    assert plan.server_commands == [command]  # what the job's plan launches
    assert "--worker-extension-cls" in command.argv and '{"backend": "ipc"}' in command.argv
    assert command.env["VLLM_SERVER_DEV_MODE"] == command.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
