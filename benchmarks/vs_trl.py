"""asyncrl against TRL's GRPOTrainer on one GPU, on the same checkpoint, data, reward and sample count (issue 36).

    python benchmarks/vs_trl.py --shapes qwen3-0.6b,qwen3.5-2b --out $OUT            # both tools, both shapes
    python benchmarks/vs_trl.py --shapes qwen3-0.6b --tools trl --work /tmp/vt --out $OUT   # one tool per call
    PYTHONPATH=/tmp/trl-site:$PWD python benchmarks/vs_trl.py --rehearse --out /tmp/vt-out  # CPU, tiny, 3 steps

For each shape (a random checkpoint built with ``benchmarks/vllm_e2e.py``'s builders and the tiny-arith tokenizer;
tiny ones in the rehearsal), TRL runs first in a child Python process, then ``python -m asyncrl train`` as a user
types it; each tool's process ends before the next starts, so GPU memory is free between them. Results land in
``--work``/results/SHAPE-TOOL.json and every call prints (and writes to ``--out``/vs_trl_SHAPE.md) the table of
whatever results --work holds for its shapes: calls of one tool each compose. ``--table`` prints them and runs
nothing.

What is the same on both sides
------------------------------
TRL's settings are read from asyncrl's composed config of the same command, so they cannot drift apart: the
shipped arithmetic prompts (``data=arithmetic``; ``data.eval_path=null``, TRL evaluates nothing either), the reward
(``reward=length``: 0.1 x completion tokens, the one reward with spread on random weights; TRL gets the very
function asyncrl builds from its registry, ``REWARDS.build``, so both score identically), 8 completions per prompt,
``max_completion_length`` (``--max-tokens``, 256), temperature 1 with no top-k/top-p, the learning rate
(``--lr``, 1e-5: ten times both tools' default 1e-6, so that ten steps move the reward of a random model), AdamW
with betas (0.9, 0.999), eps 1e-8, no weight decay, gradient clipping at 1.0, a constant schedule (TRL's default is
linear decay: set to constant), the seed, float32 master weights with bf16 autocast on the GPU (both defaults:
TRL's ``create_model_from_path`` loads float32 unless told otherwise, passed here from asyncrl's ``model.dtype``),
gradient checkpointing (both default on), and the samples trained: 256 a step (32 prompts x 8; ``--trl-batch``
32x8) for ``--steps`` (10) steps.

TRL, as its docs recommend for one GPU (TRL 1.16.0, ``trl/trainer/grpo_config.py``)
-------------------------------------------------------------------------------------
``use_vllm=True, vllm_mode="colocate"`` (vLLM in the training process, ``LLM(...,
distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
logprobs_mode="processed_logprobs")``; weights synced by ``load_weights`` of every parameter before each generation):
- ``vllm_gpu_memory_utilization=0.3``: TRL's default, the figure its colocate examples use; it leaves 70% to training.
- ``vllm_enable_sleep_mode=False``: TRL's default; sleep mode offloads weights and KV cache around each optimizer
  step, which a 0.6B/2B model on 140 GB does not need and which costs a wake-up per step.
- ``vllm_max_model_length`` unset (vLLM takes the checkpoint's 4096), ``vllm_tensor_parallel_size=1``,
  ``vllm_model_impl="vllm"``: defaults.
- ``per_device_train_batch_size=32, gradient_accumulation_steps=8`` (``--trl-batch``): 256 completions a step,
  generated in one vLLM call (``steps_per_generation`` defaults to the accumulation steps: one generation per
  optimizer step, TRL's on-policy default).
- ``optim``: TRL's default ``adamw_torch_fused`` (the same AdamW as asyncrl's ``torch.optim.AdamW``, fused kernel).
- ``logging_steps=1`` (reward and lengths per step in ``trainer.state.log_history``), ``save_strategy="no"``,
  ``report_to="none"``; the rest TRL's defaults.
- The Qwen3.5 checkpoint loads whole (``Qwen3_5ForConditionalGeneration``, from its config) on both sides; TRL
  leaves its vision tower trainable (no gradient reaches it from text, so AdamW skips it) and syncs it every step,
  asyncrl freezes it and never syncs it.
- ``processing_class``: the checkpoint's tokenizer (``padding_side="left"``, as TRL loads it). Left to itself TRL
  loads ``AutoProcessor``, which for the Qwen3.5 vision-language checkpoint builds image and video processors that
  text prompts never use (and that need torchvision, missing on the CPU machine).
- TRL's ``LLM`` gets what asyncrl's vLLM launch passes for the checkpoint (``as_asyncrl_launches``): for the
  Qwen3.5 vision-language checkpoint ``limit_mm_per_prompt`` of no images or videos (text only; without it vLLM
  0.33 fails profiling the vision tower with a dummy image), and where flashinfer is not importable (the GPU
  machine's vLLM kit does not carry it; ``pip install vllm`` would) ``gdn_prefill_backend="triton"``: on Hopper
  vLLM's default gated-DeltaNet prefill imports flashinfer.
TRL's sync is timed by wrapping ``trainer.vllm_generation.sync_weights``; its step ends by a ``TrainerCallback``.

asyncrl, as its README recommends for one GPU
---------------------------------------------
``+recipe=deepmath`` (the quick start: vLLM beside the trainer on one GPU, ipc sync, tree packing with a 16k-token
budget, score centering, ``max_staleness=4``, the trainer's measured footprint deciding vLLM's share) with
``model.name_or_path``, ``data=arithmetic data.eval_path=null reward=length`` and the matched
``sampling.max_completion_length``, ``trainer.learning_rate``, ``trainer.samples_per_step``, ``trainer.max_steps``.
``--asyncrl-extra`` adds overrides (e.g. ``loss=clipped`` for the loss closest to TRL's).

Where the algorithms differ (same reward and samples; not the same update)
--------------------------------------------------------------------------
- Loss: TRL's default ``loss_type="dapo"``: the clipped surrogate (eps 0.2), token losses summed and divided by the
  completion tokens of the whole accumulated batch; asyncrl's recipe: score centering (each token's score minus its
  expectation under the sampler's top-8, importance-weighted, no clipping), normalised by the step's tokens
  (``loss.normalization=token``), so both are token-mean over the step.
- Off-policy correction: TRL recomputes the trainer's log-probs before the step and corrects vLLM's with
  ``vllm_importance_sampling_mode="sequence_mask"`` (C_max 3); asyncrl masks per token outside [0.5, 5] of the
  sampler's processed log-probs (``importance_sampling=token_mask``), and computes no extra forward pass.
- Advantages: TRL's group z-score uses Bessel's std with eps 1e-4 and keeps zero-std groups in the batch; asyncrl's
  (``advantage=group_zscore``) uses the population std and drops zero-std groups before training.
- Staleness: TRL's colocate mode is synchronous (each step's completions come from the weights just synced);
  asyncrl generates while it trains, samples up to ``max_staleness=4`` weight versions old
  (``sample/staleness_mean`` in its metrics.jsonl). The reward curves are per optimizer step on both sides, but
  TRL's step-k reward is that of the batch step k trains (generated by the weights of step k-1), asyncrl's
  ``reward`` that of the groups scored while step k ran (generated by older weights; '-' where none was).

Columns
-------
samples/s, trained and generated tokens/s: over steps 2 to the last (step 1 carries each tool's compile and warm-ups;
samples/s also over the second half of the steps, as asyncrl's first steps after step 1 may train samples generated
ahead while step 1 ran), per second of wall clock, each tool's own clock (TRL: the callback's step ends; asyncrl:
``time_s``). Tokens are completion tokens (TRL: ``completions/mean_length`` x samples, generated = trained, nothing is
dropped; asyncrl: ``batch/trained_tokens_per_step``, and ``rollout/generated_tokens_per_s`` weighted by
``perf/step_s``). First step and time to N samples: seconds from the tool's process start to the end of that step
(asyncrl: polled from metrics.jsonl every 0.5 s); each tool compiles into caches of its own (vLLM's, Inductor's,
Triton's, asyncrl's measured footprint) under ``--work``/caches, removed before each run, so neither starts warmer for
running second; ``--warm`` keeps them from an earlier call of the same shape and tool (a user's second run on the
machine; the table's "compile caches" row says which each column had). Peak GPU GiB: the GPU's largest ``memory.used``
from nvidia-smi (every second) minus its use before the tool started: trainer and vLLM together. Sync s: mean over the
steps after the first of TRL's ``sync_weights`` and asyncrl's ``perf/weight_sync_s``. The last column, asyncrl's
advantage, is asyncrl / TRL for rates and TRL / asyncrl for times, memory and sync: above 1, asyncrl is ahead.

The GPU machine (torch 2.11, transformers 5.17, accelerate, peft; no network) needs TRL's wheel, which carries no
compiled code; its dependencies are there or in ``.whl`` (``../shared/tools/gpu-wheels.sh``: datasets). Download it
into the git-ignored ``.whl-trl/``:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform any -d .whl-trl trl==1.16.0

On the H200 (30 minutes of device time: the machine must stay warm between calls, /tmp/vt keeps the
checkpoints and each call's results, and each call prints the tables of everything --work holds): the vLLM 0.33 kit's
nine piece runs (``tools/vllm-kit/README.md``), then four calls, each ``timeout_s=600`` with carry
``[".vllm-kit-0.33/extra", ".whl", ".whl-trl"]`` (41 + 1.4 + 0.9 MB beside the 17 MB tree) and starting with

    source .vllm-kit-0.33/extra/install.sh || exit 1; [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index \
        --no-deps --target /tmp/site .whl/*.whl .whl-trl/*.whl || exit 1;
    export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH;

followed by ``python benchmarks/vs_trl.py --work /tmp/vt --out $OUT`` with, in this order (the first call of a
shape builds it: seconds for 0.6B, about a minute for 2B; the 2B runs take fewer steps, as its steps and both tools'
start-ups are slower; each limit leaves the call a minute for the rest):

    --shapes qwen3-0.6b --tools trl --run-timeout 520
    --shapes qwen3-0.6b --tools asyncrl --run-timeout 540
    --shapes qwen3.5-2b --tools asyncrl --steps 6 --run-timeout 480
    --shapes qwen3.5-2b --tools trl --steps 6 --run-timeout 540
    --shapes qwen3.5-2b --tools asyncrl --steps 6 --warm --run-timeout 480

The 2B asyncrl run twice: cold, its eager warm-up (fla's Triton kernels compiling and autotuning, ~225 s) and vLLM's
boot (~230 s, its gated-DeltaNet kernels' first profiling run) leave no steady steps in one call; the first call
fills its caches (and gives its cold first step if it gets there), the ``--warm`` one gives its steady state.

A run stopped at ``--run-timeout``, or by SIGTERM to this script, keeps the steps it logged (the table says so).
Both tools of one shape in one call do not fit: at the 0.6B shape (session 24, cold caches) TRL took 211 s for its
10 steps and asyncrl reached its first step at 224 s, its eighth at 245 s, and was stopped at its 251 s limit.
The results of session 28's calls (both tools at 0.6B, one call each, asyncrl cold and warm) and session 25's (2B)
are in ``benchmarks/results/vs_trl/``; copied into ``--work``/results first (``mkdir -p /tmp/vt/results && cp
benchmarks/results/vs_trl/*.json /tmp/vt/results/``), a call of one tool prints the table with the other's column
from them. Machines differ from day to day (session 28's TRL steps took 8.7-10.8 s, session 24's 6.6-9.0 s, with
identical rewards): compare tools measured in one session.
TRL 1.16 declares vLLM 0.22-0.31 and only warns on 0.33; its colocate calls exist in vLLM 0.33's source
(``LLM(...)``'s arguments, ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`` with the
external launcher's in-process engine, ``reset_prefix_cache``, dict-shaped per-position log-probs). Should it fail
there, ``tools/vllm-kit/build.sh 0.28.0`` makes the 0.28 kit (9 pieces, asyncrl verified on it too; carry
``.vllm-kit/extra`` instead).

``--rehearse`` (CPU): tiny Qwen3 and Qwen3.5 checkpoints, 3 steps of 16 samples (2 prompts x 8), 16-token
completions, TRL with ``use_vllm=False`` (its transformers generation), asyncrl with ``server=builtin``. Install
TRL aside for it: ``pip install --no-deps --target /tmp/trl-site .whl-trl/trl-1.16.0-py3-none-any.whl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.metrics import read_jsonl  # noqa: E402
from asyncrl.plan.assemble import build_plan  # noqa: E402
from asyncrl.serving.vllm import (  # noqa: E402
    CheckpointKind,
    checkpoint_kind,
    flashinfer_importable,
    media_limits,
)

TOOLS = ("trl", "asyncrl")
SHAPES = ("qwen3-0.6b", "qwen3.5-2b")
POLL_S = 0.5
TERMINATED = threading.Event()
"""Set by SIGTERM (a call cut at its limit): the running tool is stopped as at its time limit, its steps kept."""


@dataclasses.dataclass(frozen=True)
class Workload:
    steps: int
    samples_per_step: int
    max_tokens: int
    lr: float
    trl_batch: tuple[int, int]
    """TRL's per_device_train_batch_size and gradient_accumulation_steps (their product: samples per step)."""
    asyncrl_extra: tuple[str, ...] = ()

    @property
    def samples(self) -> int:
        return self.steps * self.samples_per_step

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(**{**data, "trl_batch": tuple(data["trl_batch"]), "asyncrl_extra": tuple(data["asyncrl_extra"])})


def asyncrl_args(model: Path, work: Workload, rehearse: bool) -> list[str]:
    """What the user types after ``asyncrl``: the one-GPU recipe, the shared checkpoint, data and reward, and the
    settings matched to TRL's."""
    return [
        "train", "+recipe=deepmath", f"model.name_or_path={model}", "data=arithmetic", "data.eval_path=null",
        "reward=length", f"sampling.max_completion_length={work.max_tokens}", f"trainer.learning_rate={work.lr}",
        f"trainer.samples_per_step={work.samples_per_step}", f"trainer.max_steps={work.steps}",
        *(["server=builtin"] if rehearse else []), *work.asyncrl_extra,
    ]  # fmt: skip


# ---- checkpoints ----------------------------------------------------------------------------------------------


def build_shape(shape: str, rehearse: bool, out: Path) -> Path:
    """The random checkpoint of ``shape`` (a tiny one of the same family in the rehearsal), on the GPU if any."""
    import torch

    from benchmarks import vllm_e2e

    if rehearse:
        builders = {
            "qwen3-0.6b": lambda: vllm_e2e.build_qwen3_shape(
                out, "qwen3-tiny", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16,
            ),
            "qwen3.5-2b": lambda: vllm_e2e.build_qwen3_5_shape(
                out, "qwen3.5-tiny", {"max_position_embeddings": 4096}, {}
            ),
        }  # fmt: skip
    else:
        builders = {
            "qwen3-0.6b": lambda: vllm_e2e.build_qwen3_0_6b_shape(out),
            "qwen3.5-2b": lambda: vllm_e2e.build_qwen3_5_2b_shape(out),
        }
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        return builders[shape]()


def shape_path(shape: str, work: Path, rehearse: bool) -> Path:
    """``shape``'s checkpoint in ``work``, built once, in a child process (this one never holds a CUDA context)."""
    done = work / "shapes" / (f"{shape}-tiny" if rehearse else shape)
    if (done / "config.json").is_file():
        return done
    building = work / "shapes" / ".building"
    subprocess.run(["rm", "-rf", str(building)], check=True)
    started = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        built = pool.submit(build_shape, shape, rehearse, building).result()
    os.replace(built, done)
    print(f"[vs_trl] built the {shape} checkpoint in {time.monotonic() - started:.0f} s: {done}", flush=True)
    return done


# ---- running one tool -----------------------------------------------------------------------------------------


def _smi_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [float(v) for v in out.split()]
    return sum(values) if values else None


class GpuPeak:
    """The GPU's largest memory use while a tool runs, minus its use before (nvidia-smi every second)."""

    def __init__(self) -> None:
        self.before = _smi_used_mib()
        self.peak = self.before
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        if self.before is not None:
            self.thread.start()

    def _poll(self) -> None:
        while not self.stopped.wait(1.0):
            used = _smi_used_mib()
            if used is not None:
                self.peak = max(self.peak or 0.0, used)

    def stop(self) -> float | None:
        self.stopped.set()
        if self.before is None or self.peak is None:
            return None
        return (self.peak - self.before) / 1024


def env(caches: Path) -> dict[str, str]:
    """The tool's environment: the repository importable, no Hub, and compile caches of its own under ``caches``
    (vLLM's, Inductor's, Triton's, ~/.cache's, asyncrl's measured trainer footprint), so the tool run second starts
    as cold as the first."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    dirs = {"XDG_CACHE_HOME": "xdg", "VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor",
            "TRITON_CACHE_DIR": "triton", "ASYNCRL_CACHE_DIR": "asyncrl"}  # fmt: skip
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            **{key: str(caches / name) for key, name in dirs.items()}}  # fmt: skip


def execute(argv: list[str], cwd: Path, stem: str, caches: Path, timeout_s: float, poll: Any = None) -> int | None:
    """``argv`` in its own session (console in ``cwd/stem.out|err``, compile caches in ``caches``), SIGTERM then
    SIGKILL to its group at ``timeout_s``; None when it was stopped there."""
    print(f"[vs_trl] $ {shlex.join(argv)}", flush=True)
    with (cwd / f"{stem}.out").open("wb") as out, (cwd / f"{stem}.err").open("wb") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, env=env(caches), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline and not TERMINATED.is_set():
            if poll is not None:
                poll()
            time.sleep(POLL_S)
    finally:
        stopped = proc.poll() is None
        if stopped:
            stop(proc)
    if poll is not None:
        poll()
    return None if stopped else proc.returncode


def caches_of(shape: str, tool: str, args: argparse.Namespace) -> Path:
    """The tool's compile caches in --work: removed before each run (cold, the default), or with ``--warm`` kept
    from an earlier call of the same shape and tool on this machine (a user's second run)."""
    caches = args.work / "caches" / f"{shape}-{tool}"
    if not args.warm:
        subprocess.run(["rm", "-rf", str(caches)], check=True)
    return caches


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group (asyncrl stops its servers on it), SIGKILL 30 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(30)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def failure(rc: int | None, rows: list[dict[str, Any]], stderr: Path, lines: int = 30) -> str | None:
    """None for a run that ended well, else why (the time limit, or the tail of its stderr)."""
    if rc == 0 and rows:
        return None
    if rc is None:
        return f"stopped (--run-timeout or SIGTERM) after {len(rows)} steps (its steps so far are in the table)"
    return "\n".join(stderr.read_text(errors="replace").splitlines()[-lines:]) if stderr.is_file() else "no stderr"


def run_trl(
    shape: str, model: Path, work: Workload, args: argparse.Namespace, typed: list[str] | None = None,
    save_steps: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """TRL's GRPOTrainer in a child Python process (``--trl-child``); its log history and timings. ``typed``: the
    asyncrl command TRL's settings are read from (default ``asyncrl_args``); ``save_steps``: save the model (only)
    every that many steps, each save's end in ``saves`` (benchmarks/time_to_accuracy.py)."""
    run_dir = args.work / "runs" / f"{shape}-trl"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    gpu = GpuPeak()
    spec = {
        "model": str(model), "asyncrl_args": (typed or asyncrl_args(model, work, args.rehearse))[1:],
        "steps": work.steps, "trl_batch": list(work.trl_batch), "use_vllm": not args.rehearse,
        "output_dir": str(run_dir), "launched": time.time(), "save_steps": save_steps,
    }  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    rc = execute([sys.executable, str(Path(__file__).resolve()), "--trl-child", str(run_dir / "spec.json")],
                 run_dir, "console", caches_of(shape, "trl", args), args.run_timeout)  # fmt: skip
    peak = gpu.stop()
    result = json.loads((run_dir / "trl.json").read_text()) if (run_dir / "trl.json").is_file() else {}
    steps = {h["step"]: h for h in result.get("log_history", []) if "reward" in h}
    ends = {int(s): t - spec["launched"] for s, t in result.get("step_ends", [])}
    rows = [
        {"step": s, "end_s": ends.get(s), "samples": work.trl_batch[0] * work.trl_batch[1], "reward": h["reward"],
         "trained_tokens": h["completions/mean_length"] * work.trl_batch[0] * work.trl_batch[1],
         "mean_length": h["completions/mean_length"]}
        for s, h in sorted(steps.items())
    ]  # fmt: skip
    for row in rows:
        row["generated_tokens"] = row["trained_tokens"]  # on-policy, one generation per step, nothing dropped
    # step 0's sync precedes the first generation (TRL copies the weights vLLM loaded): cold, and left out
    syncs = [dt for step, dt in result.get("syncs", []) if step >= 1]
    return {
        "tool": "trl", "shape": shape, "rc": rc, "rows": rows, "peak_gib": peak, "sync_s": syncs,
        "versions": result.get("versions", {}), "command": "see --trl-child; spec.json",
        "launched": spec["launched"], "saves": [(step, t - spec["launched"]) for step, t in result.get("saves", [])],
        "failure": failure(rc, rows, run_dir / "console.err"),
    }  # fmt: skip


def run_asyncrl(
    shape: str, model: Path, work: Workload, args: argparse.Namespace, typed: list[str] | None = None
) -> dict[str, Any]:
    """``python -m asyncrl train ...`` as typed (``typed``, default ``asyncrl_args``), its metrics.jsonl and the wall
    time each step appeared at."""
    run_dir = args.work / "runs" / f"{shape}-asyncrl"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cwd = args.work / "runs"
    cwd.mkdir(parents=True, exist_ok=True)
    typed = typed or asyncrl_args(model, work, args.rehearse)
    argv = [sys.executable, "-m", "asyncrl", *typed, f"hydra.run.dir={run_dir}"]
    seen: dict[int, float] = {}
    gpu = GpuPeak()
    launched, launched_at = time.monotonic(), time.time()

    def poll() -> None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            for record in read_jsonl(metrics):
                seen.setdefault(int(record["step"]), time.monotonic() - launched)

    rc = execute(argv, cwd, f"{shape}-asyncrl", caches_of(shape, "asyncrl", args), args.run_timeout, poll)
    peak = gpu.stop()
    records = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    rows = []
    for r in records:
        rate, step_s = r.get("rollout/generated_tokens_per_s"), r.get("perf/step_s")
        rows.append({
            "step": int(r["step"]), "end_s": seen.get(int(r["step"])), "clock_s": r.get("time_s"),
            "samples": r.get("batch/samples_per_step"), "reward": r.get("reward"),
            "trained_tokens": r.get("batch/trained_tokens_per_step"), "mean_length": r.get("completions/mean_length"),
            "generated_tokens": rate * step_s if rate is not None and step_s is not None else None,
            "staleness": r.get("sample/staleness_mean"), "step_s": step_s,
        })  # fmt: skip
    syncs = [float(r["perf/weight_sync_s"]) for r in records[1:] if r.get("perf/weight_sync_s") is not None]
    return {
        "tool": "asyncrl", "shape": shape, "rc": rc, "rows": rows, "peak_gib": peak, "sync_s": syncs,
        "startup": startup_phases(records[0]) if records else {},
        "command": "asyncrl " + shlex.join(typed), "launched": launched_at,
        "failure": failure(rc, rows, cwd / f"{shape}-asyncrl.err"),
    }  # fmt: skip


def startup_phases(first: dict[str, Any]) -> dict[str, float]:
    """asyncrl's start-up by phase (perf/startup_* of its first step's record: seconds from its launch, but the
    warm-up's, which is its own length): whether vLLM launched before the trainer's warm-up or after it, and what
    the first step waited for."""
    found = {key.removeprefix("perf/startup_").removesuffix("_s"): float(value) for key, value in first.items()
             if key.startswith("perf/startup_")}  # fmt: skip
    order = [phase for phase in STARTUP_PHASES if phase in found] + sorted(set(found) - set(STARTUP_PHASES))
    return {phase: found[phase] for phase in order}


STARTUP_PHASES = ("job", "model_loaded", "server_launched", "warm_up", "server_healthy", "first_step")
"""perf/startup_*'s phases in the order a run goes through them (trainer/loop.py)."""


# ---- TRL's side, in its own process ---------------------------------------------------------------------------


def trl_child(spec_path: Path) -> None:
    """GRPOTrainer with settings read from asyncrl's composed config of the same command (see the docstring)."""
    import datasets
    import torch
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.config.compose import compose, to_config
    from asyncrl.rewards import REWARDS

    spec = json.loads(spec_path.read_text())
    config = to_config(compose(spec["asyncrl_args"]))
    s, t = config.sampling, config.trainer
    cuda = torch.cuda.is_available()
    per_device, accumulation = spec["trl_batch"]

    def reward_fn(entry: dict[str, Any]) -> Any:
        reward = REWARDS.build(entry)

        def score(prompts: Any, completions: Any, completion_ids: Any, **columns: Any) -> list[float | None]:
            return reward(prompts, completions, completion_ids, **columns)

        score.__name__ = str(entry["name"])  # TRL names its reward metrics after it
        return score

    grpo = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], logging_steps=1, report_to="none",
        save_strategy="steps" if spec.get("save_steps") else "no", save_steps=spec.get("save_steps") or 500,
        save_only_model=True,
        seed=t.seed, learning_rate=t.learning_rate, lr_scheduler_type=str(t.lr_scheduler_type),
        warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon, max_grad_norm=t.max_grad_norm, gradient_checkpointing=t.gradient_checkpointing,
        bf16=cuda, model_init_kwargs={"dtype": str(config.model.dtype)},
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        num_generations=s.num_generations, max_completion_length=s.max_completion_length,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p or None,
        repetition_penalty=s.repetition_penalty, chat_template_kwargs=dict(s.chat_template_kwargs) or None,
        generation_kwargs=dict(s.generation_kwargs) or None,
        use_vllm=spec["use_vllm"], vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_enable_sleep_mode=False, disable_tqdm=True,
    )  # fmt: skip
    dataset = datasets.load_dataset("json", data_files=config.data.path, split="train")
    step_ends: list[tuple[int, float]] = []
    syncs: list[tuple[int, float]] = []
    saves: list[tuple[int, float]] = []
    versions = {m.__name__: getattr(m, "__version__", "?") for m in (trl, transformers, torch, datasets)}

    class StepEnds(transformers.TrainerCallback):
        """Each step's end and each save's, and after each step's log or save the results so far (a run stopped at
        its time limit keeps its steps)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_ends.append((state.global_step, time.time()))

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            out = {"log_history": state.log_history, "step_ends": step_ends, "syncs": syncs, "saves": saves,
                   "versions": versions}  # fmt: skip
            (Path(spec["output_dir"]) / "trl.json").write_text(json.dumps(out, indent=1))

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            saves.append((state.global_step, time.time()))
            self.on_log(args, state, control)

    if spec["use_vllm"]:
        import vllm

        versions["vllm"] = vllm.__version__
        as_asyncrl_launches(checkpoint_kind(build_plan(config)))
    # the tokenizer, as TRL's AutoProcessor would load it for a text model: for the Qwen3.5 vision-language
    # checkpoint AutoProcessor builds image and video processors (torchvision) that text prompts never use
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"], truncation_side="left", padding_side="left")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reward_fn(e) for e in config.reward_funcs], args=grpo,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepEnds()])  # fmt: skip
    if spec["use_vllm"]:
        generation = trainer.vllm_generation
        sync = generation.sync_weights

        def timed_sync(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            out = sync(*a, **k)
            if cuda:
                torch.cuda.synchronize()
            syncs.append((trainer.state.global_step, time.perf_counter() - started))
            return out

        generation.sync_weights = timed_sync
    print(f"[trl] ready {time.time() - spec['launched']:.1f} s after launch", flush=True)
    trainer.train()


def as_asyncrl_launches(kind: CheckpointKind) -> None:
    """TRL's colocated ``LLM`` gets what asyncrl's vLLM launch passes for the same checkpoint
    (``serving/vllm.py::checkpoint_flags``); TRL exposes neither option, so its ``LLM`` gets them here. A
    vision-language checkpoint serves text only (``limit_mm_per_prompt`` of no images or videos): left to itself
    vLLM profiles the vision tower with a dummy image, which the tiny-arith tokenizer's processor cannot build
    (session 25, vLLM 0.33: "Failed to apply Qwen3VLProcessor"). A gated-DeltaNet hybrid prefills with vLLM's Triton
    kernels where flashinfer is missing (the offline GPU machine's vLLM kit; ``pip install vllm`` brings it): on
    Hopper vLLM's default gated-DeltaNet prefill imports it."""
    from trl.generation import vllm_generation

    extra: dict[str, Any] = {"limit_mm_per_prompt": json.loads(media_limits(0))} if kind.vision_language else {}
    if kind.gated_deltanet and not flashinfer_importable():
        extra["gdn_prefill_backend"] = "triton"
    engine = vllm_generation.LLM

    def llm(*args: Any, **kwargs: Any) -> Any:
        return engine(*args, **extra, **kwargs)

    vllm_generation.LLM = llm


# ---- the table ------------------------------------------------------------------------------------------------


def summarise(result: dict[str, Any], target: int) -> dict[str, Any]:
    """The table's figures from one tool's per-step rows (steady: steps 2 to the last, on the tool's own clock)."""
    rows = result["rows"]
    out: dict[str, Any] = {"steps": len(rows), "samples": sum(r["samples"] or 0 for r in rows)}
    clock = [r.get("clock_s", r["end_s"]) for r in rows]
    if len(rows) >= 2 and None not in clock[:1] + clock[-1:]:
        window = clock[-1] - clock[0]
        steady = rows[1:]
        out["samples_per_s"] = sum(r["samples"] for r in steady) / window
        out["trained_per_s"] = sum(r["trained_tokens"] or 0 for r in steady) / window
        out["generated_per_s"] = generated_per_s(result["tool"], steady, window)
        middle = len(rows) // 2  # asyncrl's first steps may drain samples generated ahead during step 1
        if len(rows) >= 4 and clock[middle - 1] is not None:
            out["late_samples_per_s"] = sum(r["samples"] for r in rows[middle:]) / (clock[-1] - clock[middle - 1])
    out["first_step_s"] = rows[0]["end_s"] if rows else None
    total = 0.0
    for r in rows:
        total += r["samples"] or 0
        if total >= target:
            out["time_to_n_s"] = r["end_s"]
            break
    out["peak_gib"] = result.get("peak_gib")
    out["sync_s"] = statistics.mean(result["sync_s"]) if result.get("sync_s") else None
    lengths = [r["mean_length"] for r in rows if r["mean_length"] is not None]
    out["mean_length"] = statistics.mean(lengths) if lengths else None
    stale = [r["staleness"] for r in rows if r.get("staleness") is not None]
    out["staleness"] = statistics.mean(stale) if stale else None
    return out


def generated_per_s(tool: str, steady: list[dict[str, Any]], window: float) -> float | None:
    """TRL: what it generated over the window. asyncrl: its worker's rate (a mean over 1 s windows, absent from a
    step shorter than that) weighted by the durations of the steps that carry it."""
    if tool == "trl":
        return sum(r["generated_tokens"] for r in steady) / window
    timed = [(r["generated_tokens"], r["step_s"]) for r in steady if r["generated_tokens"] is not None]
    return sum(g for g, _ in timed) / sum(s for _, s in timed) if timed else None


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


# (label, summary key, digits, higher is better): "asyncrl's advantage" is asyncrl / TRL where higher is better, TRL /
# asyncrl where lower is (times, memory, sync): above 1, asyncrl is ahead
FIGURES = [
    ("samples/s (steps 2-last)", "samples_per_s", 1, True),
    ("samples/s (second half of the steps)", "late_samples_per_s", 1, True),
    ("trained tokens/s", "trained_per_s", 0, True),
    ("generated tokens/s", "generated_per_s", 0, True),
    ("time to N samples s (from launch)", "time_to_n_s", 1, False),
    ("first step s (from launch)", "first_step_s", 1, False),
    ("peak GPU GiB (trainer + vLLM)", "peak_gib", 1, False),
    ("weight sync s (mean, steps 2-last)", "sync_s", 3, False),
    ("mean completion length", "mean_length", 1, None),
    ("mean staleness", "staleness", 2, None),
    ("steps / samples trained", None, 0, None),
]
STARTUP = ("time_to_n_s", "first_step_s")
"""Figures that include the start-up, which compile caches shorten: compared only between runs of equal caches."""


def table(shape: str, results: dict[str, dict[str, Any]], work: Workload) -> str:
    """One shape's markdown: the figures side by side with asyncrl's ratio to TRL, then both reward curves."""
    sums = {tool: summarise(results[tool], work.samples) for tool in TOOLS if tool in results}
    # results written before --warm existed were cold
    caches = [results[tool].get("caches", "cold") if tool in results else "-" for tool in TOOLS]
    lines = [
        f"### {shape}: N = {work.samples} samples ({work.steps} steps x {work.samples_per_step}), 8 completions per "
        f"prompt, max_completion_length {work.max_tokens}, lr {work.lr:g}",
        "",
        "| | TRL GRPOTrainer | asyncrl | asyncrl's advantage |",
        "|---|---|---|---|",
    ]
    for label, key, digits, higher in FIGURES:
        if key is None:
            cells = [f"{s['steps']} / {s['samples']:.0f}" if s else "-" for s in (sums.get("trl"), sums.get("asyncrl"))]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | |")
            continue
        values = [sums[tool].get(key) if tool in sums else None for tool in TOOLS]
        ratio = ""
        if key in STARTUP and caches[0] != caches[1]:
            ratio = "not comparable: caches differ"
        elif higher is not None and None not in values and min(values) > 0:
            ratio = f"{values[1] / values[0] if higher else values[0] / values[1]:.2f}x"
        lines.append(f"| {label} | {_fmt(values[0], digits)} | {_fmt(values[1], digits)} | {ratio} |")
    lines.append(f"| compile caches at launch | {caches[0]} | {caches[1]} | |")
    phases = results.get("asyncrl", {}).get("startup")
    if phases:
        told = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in phases.items())
        lines.append(f"\nasyncrl's start-up, seconds from its launch (the warm-up: its length): {told}.")
    for tool in TOOLS:
        if tool in results and results[tool].get("failure"):
            lines.append(f"\n{tool} failed (exit {results[tool]['rc']}):\n```\n{results[tool]['failure']}\n```")
    curves = {tool: {r["step"]: r["reward"] for r in results[tool]["rows"]} for tool in TOOLS if tool in results}
    steps = sorted({s for c in curves.values() for s in c})
    lines += ["", "| step | TRL reward | asyncrl reward |", "|---|---|---|"]
    for step in steps:
        cells = [_fmt(curves.get(tool, {}).get(step), 3) for tool in TOOLS]
        lines.append(f"| {step} | {cells[0]} | {cells[1]} |")
    commands = [f"- asyncrl: `{results['asyncrl']['command']}`"] if "asyncrl" in results else []
    versions = results.get("trl", {}).get("versions")
    if versions:
        commands.append("- TRL: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return "\n".join([*lines, "", *commands]) + "\n"


# ---- main -----------------------------------------------------------------------------------------------------


def workload(args: argparse.Namespace) -> Workload:
    if args.rehearse:
        return Workload(steps=args.steps or 3, samples_per_step=16, max_tokens=16, lr=args.lr, trl_batch=(8, 2),
                        asyncrl_extra=tuple(args.asyncrl_extra))  # fmt: skip
    per_device, accumulation = (int(x) for x in args.trl_batch.split("x"))
    return Workload(
        steps=args.steps or 10, samples_per_step=per_device * accumulation, max_tokens=args.max_tokens, lr=args.lr,
        trl_batch=(per_device, accumulation), asyncrl_extra=tuple(args.asyncrl_extra),
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)}")
    parser.add_argument("--tools", default=",".join(TOOLS), help="which to run this call (default: trl,asyncrl)")
    parser.add_argument("--steps", type=int, help="optimizer steps of each tool (default 10; rehearsal 3)")
    batch = "TRL's per_device_train_batch_size x gradient_accumulation_steps: both tools' samples per step"
    parser.add_argument("--trl-batch", default="32x8", help=f"{batch} (default 32x8)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_completion_length (default 256)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate of both (default 1e-5)")
    parser.add_argument("--asyncrl-extra", nargs="*", default=[], help="more overrides for asyncrl")
    parser.add_argument("--work", type=Path, help="checkpoints, runs and results (default: a new temp dir)")
    parser.add_argument("--out", type=Path, help="vs_trl_SHAPE.md and vs_trl.json (default: --work)")
    parser.add_argument("--run-timeout", type=float, default=540.0, help="seconds each tool may take (default 540)")
    parser.add_argument("--warm", action="store_true", help="keep the tool's compile caches from an earlier call")
    parser.add_argument("--rehearse", action="store_true", help="CPU: tiny checkpoints, TRL without vLLM")
    parser.add_argument("--table", action="store_true", help="only print the tables of --work's results")
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.trl_child is not None:
        trl_child(args.trl_child)
        return
    shapes, tools = args.shapes.split(","), args.tools.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [t for t in tools if t not in TOOLS]
    if unknown:
        raise SystemExit(f"unknown shape or tool: {', '.join(unknown)}")
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="vs-trl-"))).resolve()
    args.out = (args.out or args.work).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.work / "results").mkdir(parents=True, exist_ok=True)
    work = workload(args)
    signal.signal(signal.SIGTERM, lambda *_: TERMINATED.set())
    for shape in shapes:
        if args.table or TERMINATED.is_set():
            break
        model = shape_path(shape, args.work, args.rehearse)
        for tool in tools:
            if TERMINATED.is_set():
                break
            started = time.monotonic()
            result = (run_trl if tool == "trl" else run_asyncrl)(shape, model, work, args)
            result.update(workload=dataclasses.asdict(work), caches="warm" if args.warm else "cold")
            (args.work / "results" / f"{shape}-{tool}.json").write_text(json.dumps(result, indent=1))
            print(f"[vs_trl] {shape} {tool}: exit {result['rc']}, {len(result['rows'])} steps in "
                  f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
    everything = {}
    for shape in shapes:
        results = {}
        for tool in TOOLS:
            path = args.work / "results" / f"{shape}-{tool}.json"
            if path.is_file():
                results[tool] = json.loads(path.read_text())
        if not results:
            continue
        everything[shape] = results
        text = table(shape, results, Workload.from_json(next(iter(results.values()))["workload"]))
        if len({json.dumps(r["workload"], sort_keys=True) for r in results.values()}) > 1:
            text += "\n**Not comparable: the two runs had different workloads** " + "; ".join(
                f"{tool}: {r['workload']}" for tool, r in results.items()
            ) + "\n"  # fmt: skip
        print("\n" + text, flush=True)
        (args.out / f"vs_trl_{shape}.md").write_text(text)
    (args.out / "vs_trl.json").write_text(json.dumps(everything, indent=1))
    if TERMINATED.is_set():
        raise SystemExit(143)


if __name__ == "__main__":
    main()
