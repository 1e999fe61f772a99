"""Metrics recorded when the worker scores a group (they lead training and include dropped groups).

Each value is one event (per rollout or per group); the trainer's metric window averages them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from asyncrl.rollout.images import IMAGES_COLUMN, prompt_images, thumbnail
from asyncrl.rollout.reconcile import drift
from asyncrl.rollout.tools import ToolStats
from asyncrl.rollout.types import RolloutGroup


def group_metrics(group: RolloutGroup, per_source: dict[str, np.ndarray], drop: str | None) -> dict[str, list[float]]:
    assert group.rewards is not None
    rewards = group.rewards
    scored = rewards[~np.isnan(rewards)]
    out: dict[str, list[float]] = {
        "reward": scored.tolist(),
        "reward_std": scored.tolist(),  # reduced to the spread across the window's completions (asyncrl/metrics.py)
        "frac_reward_zero_std": [1.0 if drop is not None else 0.0],
        "completions/duplicate_frac": _duplicates(group.completions_ids),
        "rollout/turns_mean": [float(len(r.turns)) for r in group.rollouts],
        "rollout/turns_max": [float(len(r.turns)) for r in group.rollouts],
        "rollout/samples_per_rollout": [float(len(s)) for s in group.completions_sequences],
    }
    if drop is None:
        out["reward_kept"] = scored.tolist()
    elif scored.size:
        out["reward_dropped"] = scored.tolist()
    for name, values in per_source.items():
        out[f"rewards/{name}/mean"] = out[f"rewards/{name}/std"] = values[~np.isnan(values)].tolist()
    for name, values in group.reward_metrics.items():  # a reward's own log_metric, under the name it gave
        out.setdefault(name, []).extend(values)
    out.update(_lengths(group))
    out.update(_reconciliation(group))
    out.update(tool_metrics([r.tool_stats for r in group.rollouts if r.tool_stats is not None]))
    return out


def _reconciliation(group: RolloutGroup) -> dict[str, list[float]]:
    """Per turn boundary: forked or not, and the held tokens the fork re-rendered (0 when clean)."""
    drifts = [float(d) for r in group.rollouts for d in drift(r.turns)]
    if not drifts:
        return {}
    return {"rollout/fork_frac": [1.0 if d > 0 else 0.0 for d in drifts],
            "rollout/drift_tokens_mean": drifts, "rollout/drift_tokens_max": drifts}  # fmt: skip


def tool_metrics(stats: list[ToolStats]) -> dict[str, list[float]]:
    """tools/*: one event per rollout, call or tool-calling message; failure_frequency is NaN without calls."""
    if not stats:
        return {}
    out: dict[str, list[float]] = defaultdict(list)
    for s in stats:
        out["tools/call_frequency"].append(float(len(s.calls)))
        out["tools/loop_exhausted_frac"].append(1.0 if s.exhausted else 0.0)
        out["tools/unknown_name_count"].append(float(s.unknown_names))
        out["tools/failure_frequency"].extend([float(f) for _, _, f in s.calls] or [math.nan])
        out["tools/parallel_calls_mean"].extend(float(n) for n in s.parallel)
        for name, latency, failed in s.calls:
            out["tools/latency_s"].append(latency)
            out[f"tools/{name}/latency_s"].append(latency)
            out[f"tools/{name}/call_count"].append(1.0)
            out[f"tools/{name}/failure_count"].append(float(failed))
    return dict(out)


def completion_records(group: RolloutGroup, advantages: np.ndarray, images: bool = False) -> list[dict[str, object]]:
    """Rows for the completions table: last prompt message, completion text, reward, advantage, and the columns the
    reward functions added (``log_extra``); ``images`` (logging.log_multimodal): the prompt's images as thumbnails
    (PNG bytes) in an ``images`` column, for prompts that have any."""
    assert group.rewards is not None
    thumbnails = [[thumbnail(image) for image in prompt_images(prompt)] if images else [] for prompt in group.prompts]
    return [
        {"prompt": _last_text(prompt), "completion": _last_text(completion), "reward": float(reward),
         "advantage": float(advantage), **{column: values[i] for column, values in group.extra_columns.items()},
         **({IMAGES_COLUMN: thumbnails[i]} if thumbnails[i] else {})}
        for i, (prompt, completion, reward, advantage) in enumerate(zip(
            group.prompts, group.completions, group.rewards, advantages, strict=True))
    ]  # fmt: skip


def _last_text(conversation: Any) -> str:
    """A plain text as it is; a conversation's last message's content, its text parts joined and each image part
    shown as <image>."""
    if isinstance(conversation, str):
        return conversation
    content = conversation[-1].get("content", "") if conversation else ""
    if not isinstance(content, list):
        return str(content)
    return "".join("<image>" if part.get("type") == "image" else str(part.get("text", "")) for part in content)


def _lengths(group: RolloutGroup) -> dict[str, list[float]]:
    lengths, terminated = [], []
    for rollout in group.rollouts:
        n = float(sum(len(t.output_ids) for t in rollout.turns))
        lengths.append(n)
        if rollout.turns and rollout.turns[-1].finish_reason == "stop":
            terminated.append(n)
    out = {
        "completions/mean_length": lengths,
        "completions/min_length": lengths,
        "completions/max_length": lengths,
        "completions/clipped_ratio": [
            0.0 if r.turns and r.turns[-1].finish_reason == "stop" else 1.0 for r in group.rollouts
        ],  # fmt: skip
    }
    if terminated:
        out.update({f"completions/{k}_terminated_length": terminated for k in ("mean", "min", "max")})
    return out


def _duplicates(completions_ids: list[list[int]]) -> list[float]:
    """Per rollout: 1.0 if it repeats an earlier rollout of its group token for token."""
    seen: set[tuple[int, ...]] = set()
    flags = []
    for ids in completions_ids:
        key = tuple(ids)
        flags.append(1.0 if key in seen else 0.0)
        seen.add(key)
    return flags
