"""Reward functions the end-to-end tests name by import path (they must be importable in the worker)."""

from __future__ import annotations


def exploding_reward(prompts, completions, completion_ids, **columns):
    raise RuntimeError("reward server unreachable (deliberate test failure)")


def wrong_length_reward(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) + 1)


def none_reward(prompts, completions, completion_ids, **columns):
    return [None] * len(completions)


def string_reward(prompts, completions, completion_ids, **columns):
    return ["good"] * len(completions)
