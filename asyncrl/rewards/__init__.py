"""Reward functions, chosen by name (or "pkg.module:attr") in the ``reward`` config group.

Importing this package registers the built-ins: ``accuracy`` (math-verify), ``format`` (one ``\\boxed{}``),
``length``, and ``reward_model`` (a sequence classifier's logit, scored on the trainer's device: reward_model.py).
"""

from __future__ import annotations

from asyncrl.rewards import accuracy, format, length, reward_model
from asyncrl.rewards.base import REWARDS, RewardFn, final_answer_text, message_text
from asyncrl.rewards.boxed import boxed_answers, last_boxed_answer

__all__ = [
    "REWARDS",
    "RewardFn",
    "accuracy",
    "boxed_answers",
    "final_answer_text",
    "format",
    "last_boxed_answer",
    "length",
    "message_text",
    "reward_model",
]
