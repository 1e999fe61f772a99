"""Reward functions the end-to-end tests name by import path (they must be importable in the worker)."""

from __future__ import annotations


def exploding_reward(prompts, completions, completion_ids, **columns):
    raise RuntimeError("reward server unreachable (deliberate test failure)")
