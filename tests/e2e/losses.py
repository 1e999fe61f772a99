"""Losses the end-to-end tests name by import path (they run in the trainer's process)."""

from __future__ import annotations

import torch

from asyncrl.losses.clipped import Clipped


class OutOfMemoryAtFifthCall(Clipped):
    """The clipped loss, until its fifth call in a process (the first is validation's check, then a row each): there
    CUDA runs out of memory, as a too large step would."""

    calls = 0

    def __call__(self, batch):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        if type(self).calls == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's injection)")
        return super().__call__(batch)
