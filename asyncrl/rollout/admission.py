"""Admission control: when may the worker start another group? (spec, "Concurrency").

The trainer grants a token allowance of max(max_staleness, 1) steps' worth of consumed tokens; the worker
starts a group only while its queued plus in-flight tokens are under it, and only while the rollouts in
flight stay under the concurrency cap. Until the first group completes, the size of a rollout is unknown,
so groups start one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    num_generations: int
    max_concurrent_rollouts: int
    inflight_groups: int = 0
    inflight_rollouts: int = 0
    completed_groups: int = 0
    tokens_pushed: int = 0
    rollouts_seen: int = 0
    mean_rollout_tokens: float = 0.0

    def inflight_tokens(self) -> float:
        """Expected tokens of the groups in flight, from the rollouts seen so far."""
        return self.inflight_rollouts * self.mean_rollout_tokens

    def queued_tokens(self, tokens_consumed: int) -> int:
        return max(0, self.tokens_pushed - tokens_consumed)

    def wait_reason(self, allowance: int, tokens_consumed: int, concurrency_cap: int) -> str | None:
        """None if a new group may start now, else what it waits on (the backpressure reason first)."""
        if self.completed_groups == 0 and self.inflight_groups > 0:
            return "first group"
        if self.queued_tokens(tokens_consumed) + self.inflight_tokens() >= allowance:
            return "backpressure"
        cap = min(concurrency_cap, self.max_concurrent_rollouts)
        if self.inflight_rollouts > 0 and self.inflight_rollouts + self.num_generations > cap:
            return "concurrency"
        return None

    def on_group_start(self) -> None:
        self.inflight_groups += 1
        self.inflight_rollouts += self.num_generations

    def on_rollout_done(self, num_tokens: int) -> None:
        self.inflight_rollouts -= 1
        self.rollouts_seen += 1
        self.mean_rollout_tokens += (num_tokens - self.mean_rollout_tokens) / self.rollouts_seen

    def on_group_done(self, pushed_tokens: int) -> None:
        self.inflight_groups -= 1
        self.completed_groups += 1
        self.tokens_pushed += pushed_tokens
