"""Seeded two-operand addition task for the embedded default.

Rows have DeepMath's conversational shape (`prompt` message list, `solution` string), so the math-verify
accuracy reward scores `\\boxed{85}` completions here exactly as it does on DeepMath. Used by
`asyncrl.assets.pretrain` and by the shipped `arith/{train,eval}.jsonl`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

MAX_OPERAND = 99
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")

Pair = tuple[int, int]
Problem = dict[str, object]
"""One dataset row: the chat prompt and the answer the accuracy reward checks."""


def question(a: int, b: int) -> str:
    """The user turn; kept short because every prompt token costs CPU time during RL."""
    return f"What is {a} + {b}?"


def build_row(a: int, b: int) -> Problem:
    """One DeepMath-shaped row for `a + b`."""
    return {"prompt": [{"role": "user", "content": question(a, b)}], "solution": str(a + b)}


def split_pairs(seed: int, n_eval: int) -> tuple[list[Pair], list[Pair]]:
    """Shuffle every operand pair and hold `n_eval` out, so eval measures problems never trained on."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    if not 0 < n_eval < len(pairs):
        raise ValueError(f"split_pairs: n_eval={n_eval} must be in 1..{len(pairs) - 1}")
    random.Random(seed).shuffle(pairs)
    return pairs[n_eval:], pairs[:n_eval]


def build_splits(seed: int, n_train: int, n_eval: int) -> dict[str, list[Problem]]:
    """Train rows come from the pairs left after the eval hold-out; both splits are fixed by `seed`."""
    train_pairs, eval_pairs = split_pairs(seed, n_eval)
    if not 0 < n_train <= len(train_pairs):
        raise ValueError(f"build_splits: n_train={n_train} must be in 1..{len(train_pairs)} for n_eval={n_eval}")
    return {
        "train": [build_row(a, b) for a, b in train_pairs[:n_train]],
        "eval": [build_row(a, b) for a, b in eval_pairs],
    }


def write_splits(out_dir: str | Path, seed: int, n_train: int, n_eval: int) -> dict[str, Path]:
    """Write `train.jsonl` and `eval.jsonl` under `out_dir`; returns the path of each split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in build_splits(seed, n_train, n_eval).items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def read_rows(path: str | Path) -> list[Problem]:
    """Rows of one written split, in file order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def extract_answer(completion: str) -> str | None:
    """Content of the last `\\boxed{...}`, the same place math-verify reads the answer from."""
    found = _BOXED.findall(completion)
    return found[-1].strip() if found else None


def is_correct(completion: str, solution: str) -> bool:
    """Exact integer check; agrees with math-verify on this task and needs no sympy during pretraining."""
    return extract_answer(completion) == solution.strip()
