"""The reward registry and the message helpers reward functions share.

A reward function is ``f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]``
(None = not applicable); the rollout worker calls it from threads and sums the results per rollout (weighted by
reward_weights). Prompts and completions are chat messages, or strings for a dataset of standard (plain-text)
prompts. Where it takes them, it also gets TRL's ``trainer_state``, ``log_metric`` and ``log_extra``
(rollout/scoring.py). A registered reward is a ``Reward`` (its options a dataclass); a user's reward, named by import
path, may also be a plain function whose named keyword parameters are its options.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.registry import Component, ComponentRegistry

RewardFn = Callable[..., list[float | None]]


class Reward(Component, ABC):
    """A registered reward function, called as ``reward(prompts, completions, completion_ids, **columns)``."""

    @abstractmethod
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                 **columns: Any) -> list[float | None]:  # fmt: skip
        """One reward per completion (None: not applicable)."""


REWARDS: ComponentRegistry[RewardFn] = ComponentRegistry(
    "reward", Reward, call_arguments=("prompts", "completions", "completion_ids")
)
"""A plain function's ``**columns`` receives the dataset's columns, not options."""

Message = dict[str, Any]


def message_text(message: Message) -> str:
    """A message's text, joining the text parts when the content is a list of typed parts."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def final_answer_text(completion: Sequence[Message] | str) -> str:
    """Text of the completion's last assistant message (earlier turns may hold tool calls); "" if none. A standard
    (plain-text) prompt's completion is that text."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message_text(message)
    return ""
