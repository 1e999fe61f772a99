"""The \\boxed{} format reward."""

from __future__ import annotations

import pytest

from asyncrl.rewards import REWARDS
from asyncrl.rewards.format import boxed_format


def as_completion(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        (r"The answer is \boxed{42}.", 1.0),
        (r"\boxed{\frac{1}{2}}", 1.0),
        (r"\boxed{\{1, 2\}}", 1.0),
        ("The answer is 42.", 0.0),
        (r"\boxed{1} or \boxed{2}", 0.0),
        (r"\boxed{}", 0.0),
        (r"\boxed{  }", 0.0),
        (r"\boxed{\frac{1}{2}", 0.0),
        (r"\boxed{1} and \boxed{2", 0.0),
    ],
)
def test_format_reward(text, reward):
    assert boxed_format(prompts=[[]], completions=[as_completion(text)], completion_ids=[[1]]) == [reward]


def test_format_reward_reads_only_the_final_assistant_message():
    completion = [
        {"role": "assistant", "content": r"draft \boxed{1}"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": r"final \boxed{2}"},
    ]
    reward = REWARDS.build("format")(prompts=[[]], completions=[completion], completion_ids=[[1]], solution=["2"])
    assert reward == [1.0]
