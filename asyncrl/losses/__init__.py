"""Losses, chosen by name from the ``loss`` config group; importing this package registers the built-ins."""

from __future__ import annotations

from asyncrl.losses import clipped, score_centering
from asyncrl.losses.base import LOSSES, LossBatch, LossFn, LossOutput, loss_requirements, requires

__all__ = [
    "LOSSES",
    "LossBatch",
    "LossFn",
    "LossOutput",
    "clipped",
    "loss_requirements",
    "requires",
    "score_centering",
]
