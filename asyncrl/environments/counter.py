"""The counter task of `recipes/counter_agent.yaml`: reach a target by calling `increment`.

The dataset row carries the target (its `target` column reaches ``reset``); the environment scores
itself, so the recipe needs no reward function.
"""

from __future__ import annotations


class IncrementEnv:
    """A counter starting at 0; success is ending the episode exactly on the target."""

    def __init__(self) -> None:
        self.counter = 0
        self.target = 0

    def reset(self, target: int, **kwargs: object) -> None:
        self.counter = 0
        self.target = int(target)

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
