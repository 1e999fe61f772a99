"""The counter task of `recipes/counter_agent.yaml`: reach a target by calling `increment`.

With a dataset, the row's `target` column reaches ``reset`` and the row's prompt states it. Without one
(data.path unset), ``reset`` samples the target itself and returns the prompt. The environment scores
itself, so the recipe needs no reward function.
"""

from __future__ import annotations

import itertools
import random

MAX_TARGET = 9
_INSTANCES = itertools.count()


def task_prompt(target: int) -> str:
    return f"Set the counter to {target}."


class IncrementEnv:
    """A counter starting at 0; success is ending the episode exactly on the target."""

    def __init__(self) -> None:
        self.counter = 0
        self.target = 0
        self._rng = random.Random(next(_INSTANCES))  # self-sampled targets replay in instance-creation order

    def reset(self, target: int | None = None, **kwargs: object) -> str | None:
        """Start an episode on the row's target, or (no dataset) on a sampled one whose prompt is returned."""
        self.counter = 0
        if target is not None:
            self.target = int(target)
            return None
        self.target = self._rng.randint(1, MAX_TARGET)
        return task_prompt(self.target)

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += int(step)
        return self.counter
