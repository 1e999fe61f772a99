"""Losses, chosen by name from the ``loss`` config group; importing this package registers the built-ins."""

from __future__ import annotations

from asyncrl.losses import cispo, clipped, gspo, luspo, sapo, score_centering, vespo
from asyncrl.losses.base import LOSSES, LossBatch, LossFn, LossOutput, loss_requirements, requires

__all__ = [
    "LOSSES",
    "LossBatch",
    "LossFn",
    "LossOutput",
    "cispo",
    "clipped",
    "gspo",
    "loss_requirements",
    "luspo",
    "requires",
    "sapo",
    "score_centering",
    "vespo",
]
