"""Format reward: the final answer is given once, in a closed, non-empty ``\\boxed{}``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.rewards.base import REWARDS, Message, Reward, final_answer_text
from asyncrl.rewards.boxed import boxed_answers


def boxed_format(
    prompts: Sequence[Sequence[Message]],
    completions: Sequence[Sequence[Message]],
    completion_ids: Sequence[Sequence[int]],
    **columns: Any,
) -> list[float | None]:
    """1.0 if the final assistant message holds exactly one ``\\boxed{}`` and it is closed and non-empty, else 0.0."""
    rewards: list[float | None] = []
    for completion in completions:
        answers = boxed_answers(final_answer_text(completion))
        rewards.append(1.0 if len(answers) == 1 and answers[0] is not None and answers[0].strip() else 0.0)
    return rewards


@REWARDS.register("format")
class Format(Reward):
    """``boxed_format``; no options."""

    def __call__(self, prompts: Sequence[Sequence[Message]], completions: Sequence[Sequence[Message]],
                 completion_ids: Sequence[Sequence[int]], **columns: Any) -> list[float | None]:  # fmt: skip
        return boxed_format(prompts, completions, completion_ids)
