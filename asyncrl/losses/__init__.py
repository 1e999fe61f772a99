"""Losses, chosen by name from the ``loss`` config group; importing this package registers the built-ins."""

from __future__ import annotations

from asyncrl.losses import cispo, clipped, gspo, luspo, sapo, score_centering, vespo
from asyncrl.losses.base import LossBatch, LossOutput
from asyncrl.losses.policy import LOSSES, PolicyLoss, PolicyOptions

__all__ = [
    "LOSSES",
    "LossBatch",
    "LossOutput",
    "PolicyLoss",
    "PolicyOptions",
    "cispo",
    "clipped",
    "gspo",
    "luspo",
    "sapo",
    "score_centering",
    "vespo",
]
