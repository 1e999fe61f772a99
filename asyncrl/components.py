"""The component registries by config group, so config validation and the CLI can list and build them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.registry import Registry


def component_registries() -> dict[str, Registry[Any]]:
    """Import every built-in component module (which registers it) and return the registries by group."""
    from asyncrl.advantages import ADVANTAGES
    from asyncrl.losses import LOSSES
    from asyncrl.packing import PACKERS
    from asyncrl.rewards import REWARDS

    return {"reward": REWARDS, "loss": LOSSES, "advantage": ADVANTAGES, "packing": PACKERS}


def build_loss(spec: Mapping[str, Any]) -> Any:
    return component_registries()["loss"].build(spec)
