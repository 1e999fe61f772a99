"""Math accuracy reward: the completion's last ``\\boxed{}`` answer checked against the gold with math-verify.

math-verify evaluates what it parses, so an answer that copies the question's own expression (``\\boxed{47 - 12}``
for "What is 47 - 12?") equals the gold: SmolLM2-135M-Instruct learned exactly that under both asyncrl and TRL
(benchmarks/RESULTS.md, session 30). Such an answer scores 0.0 unless ``reject_restated`` is off."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.rewards.base import REWARDS, Message, Reward, final_answer_text, message_text
from asyncrl.rewards.boxed import last_boxed_answer
from asyncrl.rewards.verifier import check_answers

NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")


def squeezed(text: str) -> str:
    """``text`` without whitespace: ``47 - 12`` and ``47-12`` are the same copy."""
    return re.sub(r"\s+", "", text)


def prompt_text(prompt: Sequence[Message] | str) -> str:
    """Every message's text of a conversational prompt, or a plain-text prompt itself."""
    return prompt if isinstance(prompt, str) else "\n".join(message_text(message) for message in prompt)


def restates_the_prompt(answer: str, gold: str, prompt: str) -> bool:
    """True for an answer copied from the prompt instead of worked out: found verbatim in it (whitespace aside),
    neither a bare number (a right number may well appear in the question) nor the gold's own text."""
    copied = squeezed(answer)
    return bool(copied) and not NUMBER.fullmatch(copied) and copied != squeezed(gold) and copied in squeezed(prompt)


def accuracy(
    prompts: Sequence[Sequence[Message]],
    completions: Sequence[Sequence[Message]],
    completion_ids: Sequence[Sequence[int]],
    *,
    solution: Sequence[Any],
    timeout_s: float = 5,
    reject_restated: bool = True,
    **columns: Any,
) -> list[float | None]:
    """1.0 if the last ``\\boxed{}`` of the final assistant message equals ``solution`` under math-verify, else 0.0.

    None (not applicable) where math-verify cannot parse the gold answer. Safe to call from any thread:
    math-verify runs in child processes bounded by ``timeout_s`` per parse or comparison (see verifier.py).

    Args:
        solution: the gold answer column (DeepMath's ``solution``), LaTeX without ``\\boxed``.
        timeout_s: seconds math-verify may spend on one parse or comparison before the answer scores 0.0.
        reject_restated: an answer copied from the prompt (``restates_the_prompt``) scores 0.0 without a check.
    """
    pairs = []
    for prompt, completion, gold in zip(prompts, completions, solution, strict=True):
        answer = last_boxed_answer(final_answer_text(completion)) or ""
        gold_text = "" if gold is None else str(gold)
        if reject_restated and restates_the_prompt(answer, gold_text, prompt_text(prompt)):
            answer = ""  # math-verify scores an empty answer 0.0 (or None where the gold cannot be parsed)
        pairs.append((gold_text, answer))
    return [None if verdict is None else float(verdict) for verdict in check_answers(pairs, timeout_s)]


@dataclass(frozen=True)
class AccuracyOptions:
    timeout_s: float = 5
    """Seconds math-verify may spend on one parse or comparison before the answer scores 0.0."""
    reject_restated: bool = True
    """An answer that copies an expression of the prompt (``\\boxed{47 - 12}`` for "What is 47 - 12?") scores 0.0."""


@REWARDS.register("accuracy")
class Accuracy(Reward):
    """``accuracy`` against the dataset's ``solution`` column."""

    Options = AccuracyOptions
    options: AccuracyOptions

    def __call__(self, prompts: Sequence[Sequence[Message]], completions: Sequence[Sequence[Message]],
                 completion_ids: Sequence[Sequence[int]], **columns: Any) -> list[float | None]:  # fmt: skip
        return accuracy(prompts, completions, completion_ids, timeout_s=self.options.timeout_s,
                        reject_restated=self.options.reject_restated, **columns)  # fmt: skip
