"""Math accuracy reward: the completion's last ``\\boxed{}`` answer checked against the gold with math-verify."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.rewards.base import REWARDS, Message, Reward, final_answer_text
from asyncrl.rewards.boxed import last_boxed_answer
from asyncrl.rewards.verifier import check_answer


def accuracy(
    prompts: Sequence[Sequence[Message]],
    completions: Sequence[Sequence[Message]],
    completion_ids: Sequence[Sequence[int]],
    *,
    solution: Sequence[Any],
    timeout_s: float = 5,
    **columns: Any,
) -> list[float | None]:
    """1.0 if the last ``\\boxed{}`` of the final assistant message equals ``solution`` under math-verify, else 0.0.

    None (not applicable) where math-verify cannot parse the gold answer. Safe to call from any thread:
    math-verify runs in child processes bounded by ``timeout_s`` per parse or comparison (see verifier.py).

    Args:
        solution: the gold answer column (DeepMath's ``solution``), LaTeX without ``\\boxed``.
        timeout_s: seconds math-verify may spend on one parse or comparison before the answer scores 0.0.
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution, strict=True):
        answer = last_boxed_answer(final_answer_text(completion)) or ""
        verdict = check_answer("" if gold is None else str(gold), answer, timeout_s)
        rewards.append(None if verdict is None else float(verdict))
    return rewards


@dataclass(frozen=True)
class AccuracyOptions:
    timeout_s: float = 5
    """Seconds math-verify may spend on one parse or comparison before the answer scores 0.0."""


@REWARDS.register("accuracy")
class Accuracy(Reward):
    """``accuracy`` against the dataset's ``solution`` column."""

    Options = AccuracyOptions
    options: AccuracyOptions

    def __call__(self, prompts: Sequence[Sequence[Message]], completions: Sequence[Sequence[Message]],
                 completion_ids: Sequence[Sequence[int]], **columns: Any) -> list[float | None]:  # fmt: skip
        return accuracy(prompts, completions, completion_ids, timeout_s=self.options.timeout_s, **columns)
