"""Rollout loops the end-to-end tests name by import path (they must be importable in the worker)."""

from __future__ import annotations

import zlib

from asyncrl.client import ServerError
from asyncrl.rollout.loop import AsyncRolloutLoop


class FailingForSomePrompts(AsyncRolloutLoop):
    """Generation of one prompt in four fails as a request that exhausted its retries would (decided by the
    prompt's text, so a group's rollouts fail together and a run sees the same prompts fail)."""

    async def generate_one(self, prompt, tools, group_id=0):  # type: ignore[no-untyped-def]
        if zlib.crc32(prompt[-1]["content"].encode()) % 4 == 0:
            raise ServerError(503, "/v1/completions", "deliberate test failure")
        return await super().generate_one(prompt, tools, group_id)
