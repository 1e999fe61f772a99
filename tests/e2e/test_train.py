"""The real CLI end to end on CPU: processes start, overlap, train, sync, checkpoint, resume and stop.

A tiny random-init model with the `length` reward (its completions vary in length, so groups carry signal).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.metrics import read_jsonl
from asyncrl.server.process import ServerProcess, free_port

from .helpers import CliRun, kill_marked, run_cli, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 10


def common_args(model: Path, data: Path, run_dir: Path) -> list[str]:
    return [
        f"model.name_or_path={model}", f"data.path={data / 'train.jsonl'}", "data.eval_path=null", "reward=length",
        "packing.token_budget=512", f"trainer.max_steps={STEPS}", "trainer.save_steps=5",
        "logging.console=plain", f"hydra.run.dir={run_dir}", f"server.port={free_port()}",
    ]  # fmt: skip


def steps_of(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def overlap(run_dir: Path) -> float:
    return json.loads((run_dir / "timeline.json").read_text())["summary"]["overlap_frac"]


@pytest.fixture(scope="module")
def external_server(random_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server the test owns, so it can be queried after the CLI (attached with server.launch=false) exits."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.server", "--model", str(random_tiny_model_dir), "--port", str(port),
            "--device", "cpu"]  # fmt: skip
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def async_run(random_tiny_model_dir, arithmetic_data_dir, external_server, tmp_path_factory) -> tuple[CliRun, Path]:
    run_dir = tmp_path_factory.mktemp("async") / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "staleness.max_staleness=4",
            "server.launch=false", f"server.base_url={external_server.base_url}"]  # fmt: skip
    return run_cli(args), run_dir


@pytest.fixture(scope="module")
def resumed_run(async_run, random_tiny_model_dir, arithmetic_data_dir, external_server) -> tuple[CliRun, Path]:
    first, run_dir = async_run
    if first.returncode != 0:
        pytest.skip("the first run failed")
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "trainer.max_steps=13",
            "trainer.resume_from_checkpoint=latest", "server.launch=false",
            f"server.base_url={external_server.base_url}"]  # fmt: skip
    return run_cli(args), run_dir


@pytest.fixture(scope="module", params=[0, 1])
def staleness_run(request, random_tiny_model_dir, arithmetic_data_dir, tmp_path_factory) -> tuple[int, CliRun, Path]:
    run_dir = tmp_path_factory.mktemp(f"staleness{request.param}") / "run"
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir),
            f"staleness.max_staleness={request.param}", "trainer.save_strategy=no"]  # fmt: skip
    return request.param, run_cli(args), run_dir


def test_async_run_trains_every_step_and_overlaps(async_run):
    run, run_dir = async_run
    assert run.returncode == 0, run.output[-3000:]
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["batch/trained_tokens_per_step"] > 0 for s in steps)
    assert max(s["sample/staleness_max"] for s in steps) <= 4
    assert overlap(run_dir) > 0.0  # generation and training were busy at the same time
    assert (run_dir / "model" / "model.safetensors").is_file()


def test_weights_reached_the_server(async_run, external_server):
    """After the last sync the server's logprobs equal the trained model's (float32, 1e-4)."""
    run, run_dir = async_run
    assert run.returncode == 0
    assert ControlClient(external_server.base_url).weight_version() == str(STEPS)
    import httpx

    prompt = [3, 40, 41, 42, 43]
    body = {"model": external_server_model(external_server), "prompt": prompt, "max_tokens": 12, "temperature": 1.0,
            "logprobs": 0, "seed": 7, "return_token_ids": True}  # fmt: skip
    choice = httpx.post(f"{external_server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    trained = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.allclose(trained, torch.tensor(served), atol=1e-4)


def external_server_model(server: ServerProcess) -> str:
    return ControlClient(server.base_url).served_model_name()


def test_checkpoints_are_complete(async_run):
    _, run_dir = async_run
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000005", "step_000010"]
    last = run_dir / "checkpoints" / "step_000010"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "rng_state.pt",
                 "trainer_state.json", "rollout_state.json"):  # fmt: skip
        assert (last / name).is_file(), name
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["model_version"] == STEPS
    assert json.loads((last / "rollout_state.json").read_text())["prompt_index"] > 0


def test_resume_continues_at_the_recorded_prompt_and_version(resumed_run):
    run, run_dir = resumed_run
    assert run.returncode == 0, run.output[-3000:]
    saved = json.loads((run_dir / "checkpoints" / "step_000010" / "rollout_state.json").read_text())
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000010'} at step 10, prompt {saved['prompt_index']}" in (
        (run_dir / "launch.log").read_text() + run.output
    )
    resumed = [s for s in steps_of(run_dir) if s["step"] > STEPS]
    assert [s["step"] for s in resumed] == [11, 12, 13]
    assert resumed[0]["model_version"] == 11  # versions continue from the checkpoint
    final = json.loads((run_dir / "checkpoints" / "step_000013" / "rollout_state.json").read_text())
    assert final["prompt_index"] > saved["prompt_index"]


def test_no_process_remains_after_runs(async_run, resumed_run):
    for run, _ in (async_run, resumed_run):
        assert wait_no_marked(run.marker) == []


def test_staleness_bound_and_synchronous_mode(staleness_run):
    limit, run, run_dir = staleness_run
    assert run.returncode == 0, run.output[-3000:]
    steps = steps_of(run_dir)
    assert len(steps) == STEPS
    assert max(s["sample/staleness_max"] for s in steps) <= limit
    if limit == 0:
        assert overlap(run_dir) < 0.02  # synchronous GRPO: generation waits for each sync
    assert wait_no_marked(run.marker) == []


def test_a_failing_reward_ends_the_run_with_its_traceback(random_tiny_model_dir, arithmetic_data_dir, tmp_path):
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, tmp_path / "run"),
            "reward_funcs=[{name: 'tests.e2e.rewards:exploding_reward'}]"]  # fmt: skip
    run = run_cli(args, timeout_s=120)
    assert run.returncode != 0
    assert run.seconds < 60  # startup (server, model, worker) plus the failure reaching the trainer
    assert "exploding_reward" in run.output and "deliberate test failure" in run.output
    assert "Traceback" in run.output
    leftover = wait_no_marked(run.marker)
    kill_marked(run.marker)
    assert leftover == []
