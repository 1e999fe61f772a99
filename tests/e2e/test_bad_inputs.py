"""The bad-input matrix of issue 19: each case ends with its exit code and ONE line naming the key, file or
function and the fix, no traceback on the terminal, no process left behind, and nothing that was in the run
directory changed.

Most cases fail before the server starts, so they run the real Typer app in this process (CliRunner: the same
code as the `asyncrl` command, without paying for a Python start and the imports per case); the broken inputs
are built once per module. The cases that need a running trainer (a failing reward, Ctrl-C) run the CLI as a
subprocess attached to the session's server."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.serving.process import ServerProcess, free_port

from .helpers import cli_env, kill_marked, marked_pids, run_cli, start_cli, wait_no_marked

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Broken:
    """Every broken input, made once: model directories, data files, checkpoints, a file where a directory goes."""

    root: Path
    model: Path
    data: Path

    def path(self, name: str) -> Path:
        return self.root / name


def _checkpoint_run(model_dir: Path, run_dir: Path) -> Path:
    """A run directory holding one real checkpoint (step 2) of the tiny model, as the trainer writes it."""
    from sharded import save, sharded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config.compose import compose, to_config
    from asyncrl.trainer.checkpoint import TrainerState
    from asyncrl.trainer.ranks import Ranks

    config = to_config(compose([f"model.name_or_path={model_dir}"]))
    state = TrainerState(step=2, model_version=2, prompt_index=16, prompts_consumed=16, extra={})
    with Ranks.alone() as ranks:
        model, optimizer, scheduler = sharded(config, AutoModelForCausalLM.from_pretrained(model_dir))
        return save(run_dir, state, model, AutoTokenizer.from_pretrained(model_dir), optimizer, scheduler, ranks)


def _copy_model(model_dir: Path, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    return out


@pytest.fixture(scope="module")
def broken(random_tiny_model_dir: Path, arithmetic_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Broken:
    root = tmp_path_factory.mktemp("broken")
    truncated = _copy_model(random_tiny_model_dir, root / "truncated-model") / "model.safetensors"
    os.truncate(truncated, truncated.stat().st_size // 2)
    untemplated = _copy_model(random_tiny_model_dir, root / "no-template-model")
    (untemplated / "chat_template.jinja").unlink(missing_ok=True)
    config = untemplated / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    (root / "empty.jsonl").write_text("")
    lines = (arithmetic_data_dir / "train.jsonl").read_text().splitlines()[:30]
    lines[6] = lines[6][: len(lines[6]) // 2]  # line 7 cut short
    (root / "corrupt.jsonl").write_text("\n".join(lines) + "\n")
    (root / "a-file").write_text("not a directory")
    checkpoint = _checkpoint_run(random_tiny_model_dir, root / "run-ok")
    for name, damage in {"run-bad-state": lambda c: (c / "trainer_state.json").write_text('{"step": 2, "mod'),
                         "run-truncated": lambda c: os.truncate(c / "model.safetensors", 1000),
                         "run-no-optimizer": lambda c: (c / "optimizer.pt").unlink(),
                         "run-pickled-rng": _pickle_rng_state}.items():  # fmt: skip
        shutil.copytree(checkpoint.parents[1], root / name)
        damage(root / name / checkpoint.relative_to(checkpoint.parents[1]))
    (root / "run-empty").mkdir()
    _finished_run(root / "run-done")
    (root / "torn").mkdir()
    (root / "torn" / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n{"step": 3')
    return Broken(root, random_tiny_model_dir, arithmetic_data_dir / "train.jsonl")


def _finished_run(run_dir: Path) -> None:
    """A run directory as a finished run leaves it: its metrics, its final model and its provenance."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 2\n")
    (run_dir / ".hydra" / "overrides.yaml").write_text("- trainer.max_steps=2\n")
    (run_dir / "launch.log").write_text("[2026-01-31 12:00:00,000][asyncrl][INFO] - step 2\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def _pickle_rng_state(checkpoint: Path) -> None:
    """rng_state.pt as asyncrl wrote it before it stored only tensors and plain values (numpy's state pickled)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(state, checkpoint / "rng_state.pt")


def _snapshot(run_dir: Path) -> dict[str, str]:
    if not run_dir.exists():
        return {}
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}  # fmt: skip


def _message_lines(output: str) -> list[str]:
    """The terminal's lines less progress bars (datasets, transformers) and log records ("[date][logger][LEVEL]")."""
    noise = re.compile(r"^\[\d{4}-\d\d-\d\d |( examples| ?it)/s\]")
    return [line for line in output.strip().splitlines() if line.strip() and not noise.search(line)]


def _base(b: Broken, run_dir: Path) -> list[str]:
    return [f"model.name_or_path={b.model}", f"data.path={b.data}", "data.num_eval_prompts=0", "trainer.max_steps=2",
            f"server.port={free_port()}", f"hydra.run.dir={run_dir}"]  # fmt: skip


# (overrides relative to the broken inputs, the run directory, exit code, the text the one line must hold): every
# bad input is a configuration error, exit code 2, and leaves the run directory as it was (none if there was none)
TRAIN_CASES = {
    "missing model path": (["model.name_or_path={root}/no-such-model"], "{tmp}/run", 2,
                           "model.name_or_path={root}/no-such-model: no such directory"),
    "truncated model.safetensors": (["model.name_or_path={root}/truncated-model"], "{tmp}/run", 2,
                                    "truncated-model/model.safetensors is damaged"),
    "model.dtype=bf16": (["model.dtype=bf16"], "{tmp}/run", 2,
                         "model.dtype: Invalid value 'bf16', expected one of [auto, float32, bfloat16, float16]"),
    "lr_scheduler_type=cosinee": (["trainer.lr_scheduler_type=cosinee"], "{tmp}/run", 2,
                                  "trainer.lr_scheduler_type: Invalid value 'cosinee'"),
    "misspelt key": (["trainer.learning_rat=1e-4"], "{tmp}/run", 2,
                     "trainer.learning_rat: no such key (did you mean trainer.learning_rate?); the keys of settings "
                     "group 'trainer': output_dir, seed"),
    "appended unknown key": (["+sampling.temprature=0.7"], "{tmp}/run", 2,
                             "sampling.temprature: no such key (did you mean sampling.temperature?)"),
    "Hub model offline": (["model.name_or_path=nobody/no-such-model"], "{tmp}/run", 2,
                          "model.name_or_path=nobody/no-such-model: not on this machine (no such path, not in the "
                          "Hugging Face cache) and the Hub cannot be reached (HF_HUB_OFFLINE=1): give a local model "
                          "directory"),
    "Hub dataset offline": (["data.path=nobody/no-such-prompts"], "{tmp}/run", 2,
                            "data.path=nobody/no-such-prompts: not on this machine"),
    "tokenizer without chat template": (["model.name_or_path={root}/no-template-model"], "{tmp}/run", 2,
                                        "its tokenizer has no chat template"),
    "empty data file": (["data.path={root}/empty.jsonl"], "{tmp}/run", 2,
                        "data.path={root}/empty.jsonl: the file is empty"),
    "corrupt JSONL line": (["data.path={root}/corrupt.jsonl"], "{tmp}/run", 2,
                           "{root}/corrupt.jsonl:7: not valid JSON"),
    "hydra.run.dir under a file": ([], "{root}/a-file/run", 2,
                                   "hydra.run.dir={root}/a-file/run: {root}/a-file is a file, not a directory"),
    "resume latest without checkpoint": (["trainer.resume_from_checkpoint=latest"], "{root}/run-empty", 2,
                                         "trainer.resume_from_checkpoint=latest: no checkpoint in"),
    "resume from a missing path": (["trainer.resume_from_checkpoint={root}/nowhere"], "{tmp}/run", 2,
                                   "trainer.resume_from_checkpoint={root}/nowhere: no such directory"),
    "resume with corrupt trainer_state.json": (["trainer.resume_from_checkpoint=latest"], "{root}/run-bad-state", 2,
                                               "step_000002/trainer_state.json is not valid JSON"),
    "resume with truncated weights": (["trainer.resume_from_checkpoint=latest"], "{root}/run-truncated", 2,
                                      "step_000002/model.safetensors is damaged"),
    "resume without optimizer.pt": (["trainer.resume_from_checkpoint=latest"], "{root}/run-no-optimizer", 2,
                                    "step_000002/optimizer.pt is missing"),
    "a finished run's directory": ([], "{root}/run-done", 2, "{root}/run-done already holds a run"),
    "streamed prompts an attached vLLM would be sized by": (
        ["data.streaming=true", "server.launch=false", "server.base_url=http://127.0.0.1:9"], "{tmp}/run", 2,
        "is streamed (data.streaming=true): its 'prompt' column cannot be read whole"),
    "resume from a pickled rng_state.pt": (["trainer.resume_from_checkpoint=latest"], "{root}/run-pickled-rng", 2,
                                           "rng_state.pt holds Python objects that only a code-running load can "
                                           "restore (numpy"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_bad_input_is_one_line(case: str, broken: Broken, invoke, tmp_path: Path) -> None:
    overrides, run_dir, code, expected = TRAIN_CASES[case]
    fill = {"root": broken.root, "tmp": tmp_path}
    run_dir = Path(run_dir.format(**fill))
    before, existed = _snapshot(run_dir), run_dir.exists()
    result = invoke(["train", *_base(broken, run_dir), *(o.format(**fill) for o in overrides)])
    lines = _message_lines(result.output)
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and expected.format(**fill) in lines[0], result.output
    assert "Traceback" not in result.output
    assert _snapshot(run_dir) == before and run_dir.exists() == existed, result.output


def test_serve_on_a_busy_port_or_a_missing_model(broken: Broken, invoke, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = invoke(["serve", f"model.name_or_path={broken.model}", f"server.port={port}",
                         f"trainer.output_dir={tmp_path}"])  # fmt: skip
    assert result.exit_code == 2 and _message_lines(result.output) == [
        f"config error: server.port={port}: 127.0.0.1:{port} is already in use (another server?); choose a "
        "free one with server.port=N, or attach to it with server.launch=false"
    ]
    result = invoke(["serve", f"model.name_or_path={broken.root}/no-such-model", f"trainer.output_dir={tmp_path}"])
    assert result.exit_code == 2 and len(_message_lines(result.output)) == 1
    assert f"model.name_or_path={broken.root}/no-such-model: no such directory" in result.output
    result = invoke(["serve", str(broken.root / "run-empty")])
    assert result.exit_code == 2 and _message_lines(result.output) == [
        f"config error: asyncrl serve {broken.root}/run-empty: {broken.root}/run-empty: no model to export: no "
        "adapter_config.json, no config.json with model.safetensors, no model/ and no checkpoints/step_* inside"
    ]
    result = invoke(["serve", f"model.name_or_path={broken.model}", "server.replicas=2"])
    assert result.exit_code == 2 and _message_lines(result.output) == [
        "config error: server.replicas=2: asyncrl serve runs one server; start one per port (server.port=P) "
        "and attach the run to them with server.launch=false server.base_urls=[...]"
    ]


def test_report_skips_a_torn_last_line_with_a_warning(broken: Broken, tmp_path: Path) -> None:
    run_dir = shutil.copytree(broken.path("torn"), tmp_path / "torn")
    proc = subprocess.run([sys.executable, "-m", "asyncrl", "report", str(run_dir)], capture_output=True, text=True,
                          env=cli_env("report"), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run_dir / "report" / "index.html")
    assert proc.stderr.strip() == f"{run_dir}/metrics.jsonl:3: incomplete last line skipped (the run was stopped " \
        "while writing it)"  # fmt: skip


def _attached(server: ServerProcess, b: Broken, run_dir: Path) -> list[str]:
    """On the session's server; reward=length: the random model's groups get distinct rewards, so steps happen."""
    return ["train", *_base(b, run_dir), "server.launch=false", f"server.base_url={server.base_url}",
            "trainer.cpu_threads=1", "logging.console=plain", "sampling.num_generations=4",
            "reward=length"]  # fmt: skip


def test_a_failing_reward_is_one_line_naming_it_and_its_row(broken: Broken, tmp_path: Path) -> None:
    """A launched server, so that its teardown after the failure is checked too."""
    run_dir = tmp_path / "run"
    run = run_cli(["train", *_base(broken, run_dir), "logging.console=plain", "sampling.num_generations=4",
                   "reward_funcs=[{name: 'tests.e2e.rewards:exploding_reward'}]"], timeout_s=180)  # fmt: skip
    errors = [line for line in run.output.splitlines() if line.startswith("error")]
    assert run.returncode == 1
    assert len(errors) == 1 and errors[0].startswith(
        "error (RolloutWorkerError): the rollout worker failed: reward function 'exploding_reward' on row "
    ), run.output[-2000:]
    assert "raised RuntimeError: reward server unreachable (deliberate test failure)" in errors[0]
    assert "Traceback" not in run.output
    assert "Traceback" in (run_dir / "launch.log").read_text()  # the worker's traceback went to the run's log
    leftover = wait_no_marked(run.marker)
    kill_marked(run.marker)
    assert leftover == []


def test_ctrl_c_in_a_background_job_stops_and_says_how_to_resume(tiny_server: ServerProcess, broken: Broken,
                                                                  tmp_path: Path) -> None:  # fmt: skip
    """Started with SIGINT ignored, as a script's background job is: Ctrl-C (SIGINT) still stops the run."""
    run_dir = tmp_path / "run"
    args = [*_attached(tiny_server, broken, run_dir), "trainer.max_steps=50", "trainer.save_steps=1"]
    proc, marker = start_cli(args, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 150
        while not list((run_dir / "checkpoints").glob("step_*[0-9]")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        kill_marked(marker)
    assert proc.returncode == 128 + signal.SIGINT, output[-2000:]
    last = [line for line in output.splitlines() if line.startswith("interrupted")]
    assert len(last) == 1 and " with: asyncrl train " in last[0], output[-2000:]
    assert last[0].endswith(f"trainer.resume_from_checkpoint=latest hydra.run.dir={run_dir}")
    assert last[0] in (run_dir / "launch.log").read_text()  # kept where a console piped through tee loses it
    assert "Traceback" not in output
    assert wait_no_marked(marker) == [] and marked_pids(marker) == []
