"""The real CLI end to end on CPU: processes start, overlap, train, sync, checkpoint, resume and stop.

A tiny random-init model with the `length` reward (its completions vary in length, so groups carry signal).
The runs attach to the session's built-in server; the launched server is covered by test_default.py (whose
run also checks the default staleness bound, 4, with the default loss) and by the failing-reward run here.
The async run uses a non-default loss and advantage estimator (CISPO, RLOO) with an adaptive entropy
coefficient, so that its checkpoint and resume carry loss state too (the other losses are exercised through the
real trainer step in tests/losses/test_trainer_step.py, which costs no server or worker start), and steps of a fixed
number of samples (trainer.samples_per_step) spanning several rows. Both runs evaluate every 2 steps (at checkpoints,
then by logging.eval_steps); the resumed one finds the abandoned steps an interrupted run leaves in metrics.jsonl.
The async run's reward (tests/e2e/rewards.py) checks that generation starts beside the first evaluation; a callback
(tests/e2e/callbacks.py) records each hook of both runs, and its stop ends the resumed run a step before its
trainer.max_steps, as max_steps would.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.client import ControlClient
from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import ServerProcess, free_port

from .callbacks import LOG_ENV as CALLBACK_LOG_ENV
from .callbacks import STOP_ENV
from .helpers import CliRun, run_cli, served_vs_trained, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 4
SAVE_STEPS = STEPS // 2
RESUMED = [STEPS + 1, STEPS + 2, STEPS + 3]
CISPO = ["loss=cispo", "advantage=rloo", "loss.entropy_coef=0.01", "loss.entropy_target=100.0"]
ENTROPY_DELTA = 0.005  # the default loss.entropy_coef_delta
EVAL_PROMPTS = 4  # evaluated before, every SAVE_STEPS steps and after: a second each on the tiny model
EVALS = ("eval/greedy_reward", "eval/sampled_reward")
SAMPLES = 32  # the async run's trainer.samples_per_step: 4 groups, more than a 512-token row holds
CALLBACK = "tests.e2e.callbacks:RecordHooks"
SIGNAL_ENV = "ASYNCRL_TEST_SIGNAL_DIR"


def common_args(model: Path, data: Path, run_dir: Path) -> list[str]:
    return [
        f"model.name_or_path={model}", f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
        f"data.num_eval_prompts={EVAL_PROMPTS}", "reward=length",
        "packing.token_budget=512", f"trainer.max_steps={STEPS}", f"trainer.save_steps={SAVE_STEPS}",
        "logging.console=plain", "logging.report=false", f"hydra.run.dir={run_dir}", f"server.port={free_port()}",
    ]  # fmt: skip


def attach(server: ServerProcess) -> list[str]:
    """The session's server runs on this machine's CPU: the trainer leaves it its core, as with a launched one."""
    return ["server.launch=false", f"server.base_url={server.base_url}", "trainer.cpu_threads=1"]


def steps_of(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def overlap(run_dir: Path) -> float:
    return json.loads((run_dir / "timeline.json").read_text())["summary"]["overlap_frac"]


@dataclass
class AttachedRun:
    """A run and what the server served right after it (later runs share the server and change it)."""

    run: CliRun
    run_dir: Path
    served_version: str
    served_gap: float


@pytest.fixture(scope="module")
def async_run(random_tiny_model_dir, arithmetic_data_dir, fresh_server, tmp_path_factory) -> AttachedRun:
    """Its reward is `length`'s (the completion's token count) under another name, which leaves signals in
    <root>/signals (tests/e2e/rewards.py); the callback logs to <root>/callbacks.jsonl and does not stop it."""
    server = fresh_server()
    root = tmp_path_factory.mktemp("async")
    run_dir = root / "run"
    (root / "signals").mkdir()
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir), "staleness.max_staleness=1",
            *CISPO, "logging.profile_steps=[3]", "trainer.peak_tflops=0.5", f"trainer.samples_per_step={SAMPLES}",
            "logging.eval_on_save=true", "reward_funcs=[{name: 'tests.e2e.rewards:eval_waits_for_the_worker_reward'}]",
            f"trainer.callbacks=[{CALLBACK}]", *attach(server)]  # fmt: skip
    run = run_cli(args, env={SIGNAL_ENV: str(root / "signals"), CALLBACK_LOG_ENV: str(root / "callbacks.jsonl")})
    version, gap = ControlClient(server.base_url).weight_version(), math.inf
    if run.returncode == 0:
        trained = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
        gap = served_vs_trained(server.base_url, trained)
    return AttachedRun(run, run_dir, version, gap)


@pytest.fixture(scope="module")
def resumed_run(async_run, random_tiny_model_dir, arithmetic_data_dir, session_server) -> tuple[CliRun, Path]:
    """Resumed in synchronous mode (max_staleness=0), which its 3 steps also check. No fresh server: the resumed
    trainer pushes its checkpoint's weights before generating. It saves twice (periodic, final): three checkpoints
    kept (tiny_arith keeps 2) leave the one it resumed from, which the tests read, and still prune the first. Its
    trainer.max_steps is one step past RESUMED: the callback stops it after RESUMED[-1] (<root>/resumed_callbacks.jsonl
    has its hooks)."""
    if async_run.run.returncode != 0:
        pytest.skip("the first run failed")
    run_dir = async_run.run_dir
    (run_dir / "eval_first_run.json").write_text((run_dir / "eval.json").read_text())  # this run writes its own
    with (run_dir / "metrics.jsonl").open("a") as f:  # as a run interrupted after its last checkpoint leaves it
        f.write(json.dumps({**steps_of(run_dir)[-1], "step": STEPS + 1, "abandoned": True}) + "\n")
    args = ["train", *common_args(random_tiny_model_dir, arithmetic_data_dir, run_dir),
            f"trainer.max_steps={RESUMED[-1] + 1}", "staleness.max_staleness=0", *CISPO,
            "trainer.resume_from_checkpoint=latest", "trainer.save_total_limit=3", f"logging.eval_steps={SAVE_STEPS}",
            f"trainer.callbacks=[{CALLBACK}]", *attach(session_server)]  # fmt: skip
    env = {STOP_ENV: str(RESUMED[-1]), CALLBACK_LOG_ENV: str(run_dir.parent / "resumed_callbacks.jsonl")}
    return run_cli(args, env=env), run_dir


def test_async_run_trains_every_step_within_its_staleness_bound_and_overlaps(async_run):
    run, run_dir = async_run.run, async_run.run_dir
    assert run.returncode == 0, run.output[-3000:]
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["batch/trained_tokens_per_step"] > 0 for s in steps)
    assert all(s["batch/samples_per_step"] == SAMPLES and s["batch/microbatches_per_step"] >= 2 for s in steps)
    assert max(s["sample/staleness_max"] for s in steps) <= 1
    assert overlap(run_dir) > 0.0  # generation and training were busy at the same time
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert not (run_dir / "report").exists()  # logging.report=false (the report: test_default.py, test_multirun.py)
    # the load poller's scrapes of the server's /metrics reach the logs (its dict outlives each flush)
    usage = [s.get("rollout/vllm_kv_cache_usage_frac", math.nan) for s in steps]
    assert any(not math.isnan(u) for u in usage)


def test_the_console_has_whole_lines_no_progress_bars_and_the_runs_wall_time(async_run):
    """Without a terminal nothing wraps (a line starting with "step" is a step line; the startup and held-out
    lines are whole), no library's progress bar shows, and the closing line's wall time is timeline.json's."""
    run, run_dir = async_run.run, async_run.run_dir
    assert run.returncode == 0, run.output[-3000:]
    lines = run.output.splitlines()
    assert "Generating train split" not in run.output and "Loading weights" not in run.output
    assert all(re.match(rf"step \d+/{STEPS}  reward ", line) for line in lines if line.startswith("step"))
    assert any(line.startswith("startup (seconds since launch): job ") and "model loaded" in line
               and "first step" in line for line in lines)  # fmt: skip
    first = steps_of(run_dir)[0]  # counted from the command's start: its imports and checks came before the job's
    assert 0 < first["perf/startup_job_s"] < first["perf/startup_model_loaded_s"] < first["perf/startup_first_step_s"]
    assert any(line.startswith("held-out reward on") and line.endswith("preferred answer changes)") for line in lines)
    wall = json.loads((run_dir / "timeline.json").read_text())["summary"]["wall_s"]
    assert f"done after {STEPS} steps in {wall:.0f} s; model saved to" in run.output


def test_the_chosen_step_is_profiled_with_its_phases_labelled(async_run):
    profile = async_run.run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["step_3.trace.json", "step_3.txt"]
    trace = (profile / "step_3.trace.json").read_text()
    for name in ("rollout_wait", "forward", "backward", "optimizer", "weight_sync"):
        assert f'"asyncrl/{name}"' in trace
    assert "aten::" in (profile / "step_3.txt").read_text()


def test_cispo_with_rloo_trains_and_checkpoints_the_entropy_coefficient(async_run):
    run_dir = async_run.run_dir
    assert async_run.run.returncode == 0, async_run.run.output[-3000:]
    steps = steps_of(run_dir)
    assert all(math.isfinite(s["cispo_clip_ratio"]) and math.isfinite(s["policy_loss"]) for s in steps)
    # the tiny model's entropy is far below a 100-nat target: the coefficient rises by delta every step
    assert [s["entropy_coef"] for s in steps] == pytest.approx([0.01 + ENTROPY_DELTA * i for i in range(STEPS)])
    state = json.loads((run_dir / "checkpoints" / f"step_{STEPS:06d}" / "trainer_state.json").read_text())
    assert state["extra"]["loss"] == {"entropy_coef": pytest.approx(0.01 + ENTROPY_DELTA * STEPS)}


def test_weights_reached_the_server(async_run):
    """After the last sync the server's logprobs equal the trained model's (float32, 1e-4)."""
    assert async_run.run.returncode == 0
    assert async_run.served_version == str(STEPS)
    assert async_run.served_gap <= 1e-4


def test_checkpoints_are_complete(async_run):
    run_dir = async_run.run_dir
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{SAVE_STEPS:06d}", f"step_{STEPS:06d}"]
    last = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "rng_state.pt",
                 "trainer_state.json", "rollout_state.json"):  # fmt: skip
        assert (last / name).is_file(), name
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["model_version"] == STEPS
    assert json.loads((last / "rollout_state.json").read_text())["prompt_index"] > 0


def test_resume_continues_at_the_recorded_prompt_and_version(resumed_run):
    run, run_dir = resumed_run
    assert run.returncode == 0, run.output[-3000:]
    last = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    saved = json.loads((last / "rollout_state.json").read_text())
    assert f"resumed from {last} at step {STEPS}, prompt {saved['prompt_index']}" in (
        (run_dir / "launch.log").read_text() + run.output
    )
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(1, RESUMED[-1] + 1))  # the abandoned step 5 row was dropped
    assert not any("abandoned" in s for s in steps)
    resumed = [s for s in steps if s["step"] > STEPS]
    assert resumed[0]["model_version"] == RESUMED[0]  # versions continue from the checkpoint
    assert resumed[0]["entropy_coef"] == pytest.approx(0.01 + ENTROPY_DELTA * STEPS)  # and the loss state
    final = json.loads((run_dir / "checkpoints" / f"step_{RESUMED[-1]:06d}" / "rollout_state.json").read_text())
    assert final["prompt_index"] > saved["prompt_index"]
    assert f"done after {RESUMED[-1]} steps ({len(RESUMED)} in this launch) in " in run.output


def test_held_out_evaluation_runs_every_eval_steps_and_a_resume_starts_from_its_checkpoints(async_run,
                                                                                          resumed_run):  # fmt: skip
    """eval/* at steps 2 and 4 (the first run's checkpoints: logging.eval_on_save) and 6 (the resumed run's
    logging.eval_steps=2) of metrics.jsonl. The first run's "after" is its step 4 evaluation, which its checkpoint
    keeps: the resumed run's "before" is that one, labelled as the checkpoint's (not evaluated again), and its
    "after" is step 7's, evaluated after the loop."""
    run, run_dir = resumed_run
    assert run.returncode == 0, run.output[-3000:]
    evaluated = {s["step"]: {k: s[k] for k in EVALS} for s in steps_of(run_dir) if EVALS[0] in s}
    assert sorted(evaluated) == [2, 4, 6] and all(math.isfinite(v) for e in evaluated.values() for v in e.values())
    first = json.loads((run_dir / "eval_first_run.json").read_text())
    assert (first["before_model"], first["before_step"], first["after_step"]) == ("base model", 0, STEPS)
    assert first["after"] == evaluated[STEPS]
    resumed = json.loads((run_dir / "eval.json").read_text())
    assert (resumed["before_model"], resumed["before_step"]) == (f"checkpoint step {STEPS}", STEPS)
    assert resumed["before"] == evaluated[STEPS] and resumed["after_step"] == RESUMED[-1]
    assert f"held-out reward on {EVAL_PROMPTS} prompts, checkpoint step {STEPS} -> step {RESUMED[-1]}" in run.output
    assert "held-out evaluation at step 6: greedy_reward" in run.output


def test_no_process_remains_after_runs(async_run, resumed_run):
    for run in (async_run.run, resumed_run[0]):
        assert wait_no_marked(run.marker) == []


def test_synchronous_mode_waits_for_each_sync(resumed_run):
    run, run_dir = resumed_run
    assert run.returncode == 0, run.output[-3000:]
    resumed = [s for s in steps_of(run_dir) if s["step"] > STEPS]
    assert max(s["sample/staleness_max"] for s in resumed) <= 0
    assert overlap(run_dir) < 0.02  # synchronous GRPO: generation waits for each sync (timeline of this run)


def test_mfu_is_logged_where_the_peak_is_known(async_run, resumed_run):
    """The first run names a peak (a CPU has none in the table), the resumed one does not: no MFU there."""
    steps = steps_of(async_run.run_dir)
    first, resumed = [s for s in steps if s["step"] <= STEPS], [s for s in steps if s["step"] > STEPS]
    assert first and resumed
    for s in first:
        assert 0 < s["perf/wall_clock_mfu"] < s["perf/fwd_bwd_mfu"] < 1  # a step is longer than its fwd+bwd
    assert not any("perf/fwd_bwd_mfu" in s or "perf/wall_clock_mfu" in s for s in resumed)


def test_the_first_groups_generate_beside_the_first_evaluation(async_run):
    """The rollout worker starts before the "before" evaluation, so the first step's groups need not wait for it:
    the evaluation's reward calls meet the worker's (tests/e2e/rewards.py)."""
    assert async_run.run.returncode == 0, async_run.run.output[-3000:]
    outcomes = sorted(path.suffix for path in (async_run.run_dir.parent / "signals").glob("*.*"))
    assert outcomes == [".met", ".met"], outcomes  # the trainer's and the worker's


def test_a_callback_sees_each_hook_and_its_stop_ends_the_run_as_max_steps_would(async_run, resumed_run):
    """The async run (not stopped): the "before" evaluation, then each step's hooks, evaluations and checkpoints in
    order. The resumed run, stopped after step 7 of 8 by control.should_training_stop: it still evaluates,
    checkpoints and saves its model as at trainer.max_steps (step 7 is neither an evaluation nor a save step), and
    the callback saw each of those in order."""
    assert async_run.run.returncode == 0, async_run.run.output[-3000:]
    events = read_jsonl(async_run.run_dir.parent / "callbacks.jsonl")
    assert [(e["hook"], e["step"]) for e in events] == [
        ("on_evaluate", 0), ("on_step_end", 1), ("on_log", 1), ("on_step_end", 2), ("on_evaluate", 2), ("on_log", 2),
        ("on_save", 2), ("on_step_end", 3), ("on_log", 3), ("on_step_end", 4), ("on_evaluate", 4), ("on_log", 4),
        ("on_save", 4),
    ]  # fmt: skip
    assert events[0]["metrics"] == sorted(EVALS) and events[2]["has_reward"]
    assert "set control.should_training_stop" not in async_run.run.output
    run, run_dir = resumed_run
    assert run.returncode == 0, run.output[-3000:]
    events = read_jsonl(run_dir.parent / "resumed_callbacks.jsonl")
    assert [(e["hook"], e["step"]) for e in events] == [
        ("on_step_end", 5), ("on_log", 5), ("on_step_end", 6), ("on_evaluate", 6), ("on_log", 6), ("on_save", 6),
        ("on_step_end", 7), ("on_log", 7), ("on_evaluate", 7), ("on_save", 7),
    ]  # fmt: skip
    assert all(e["metrics"] == sorted(EVALS) for e in events if e["hook"] == "on_evaluate")
    assert (events[-1]["checkpoint"], events[-1]["whole"]) == (f"step_{RESUMED[-1]:06d}", True)
    assert [s["step"] for s in steps_of(run_dir)][-1] == RESUMED[-1]
    final = load_file(str(run_dir / "model" / "model.safetensors"))  # this run's final model, not the first run's
    saved = load_file(str(run_dir / "checkpoints" / f"step_{RESUMED[-1]:06d}" / "model.safetensors"))
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in saved)
    assert f"{CALLBACK} (trainer.callbacks) set control.should_training_stop at step {RESUMED[-1]}" in run.output
    assert f"done after {RESUMED[-1]} steps ({len(RESUMED)} in this launch) in " in run.output
