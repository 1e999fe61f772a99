"""The configured components of a run, built once: validation checks them, the trainer and the worker run them.

``build_components`` resolves the four component groups (``reward_funcs``, ``loss``, ``advantage``,
``packing``) against their registries; a misspelt name or option fails with one line naming the key and the
real ones. The rewards and the estimator travel to the rollout worker in its spec, pickled (checked once, by
``asyncrl.trainer.setup.prepare``); the loss and the packer stay with the trainer (unpickling them would import
torch into the worker, which runs without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.config.errors import ConfigError
from asyncrl.config.messages import moved_key
from asyncrl.registry import ComponentRegistry, RegistryError
from asyncrl.rollout.scoring import RewardSource, reward_name

if TYPE_CHECKING:
    from asyncrl.advantages import Estimator
    from asyncrl.config.schema import Config
    from asyncrl.losses import PolicyLoss
    from asyncrl.packing import Packer


@dataclass(frozen=True)
class Components:
    loss: PolicyLoss
    advantage: Estimator
    packer: Packer
    rewards: list[RewardSource]
    """The reward functions in ``reward_funcs`` order, named for metrics."""


def component_registries() -> dict[str, ComponentRegistry[Any]]:
    """Import every built-in component module (which registers it) and return the registries by group."""
    from asyncrl.advantages import ADVANTAGES
    from asyncrl.losses import LOSSES
    from asyncrl.packing import PACKERS
    from asyncrl.rewards import REWARDS

    return {"reward": REWARDS, "loss": LOSSES, "advantage": ADVANTAGES, "packing": PACKERS}


def build_components(config: Config) -> Components:
    """Every component group of ``config``, built; a bad name or option raises ConfigError naming its key."""
    registries = component_registries()
    rewards = []
    weights = config.reward_weights or [1.0] * len(config.reward_funcs)
    for index, (spec, weight) in enumerate(zip(config.reward_funcs, weights, strict=True)):
        fn = _build(registries["reward"], spec, f"reward_funcs[{index}]")
        rewards.append(RewardSource(_metric_name(spec["name"], fn, registries["reward"]), fn, float(weight)))
    advantage = _build(registries["advantage"], config.advantage, "advantage")
    advantage.reward_weights = {source.name: source.weight for source in rewards}
    return Components(
        loss=_build(registries["loss"], config.loss, "loss"),
        advantage=advantage,
        packer=_build(registries["packing"], config.packing, "packing"),
        rewards=rewards,
    )


def _metric_name(name: str, fn: Any, registry: ComponentRegistry[Any]) -> str:
    """A reward's name in its metrics (rewards/<name>/mean): a reward model's checkpoint (TRL's), a registered
    reward's name, a user's function's own."""
    from asyncrl.rewards.reward_model import RewardModel

    if isinstance(fn, RewardModel):
        return fn.metric_name
    return name if name in registry else reward_name(fn)


def _build(registry: ComponentRegistry[Any], spec: Mapping[str, Any], key: str) -> Any:
    try:
        return registry.build(spec)
    except RegistryError as exc:
        raise ConfigError(f"{key}: {exc}{''.join(moved_key(f'{key}.{option}') for option in spec)}") from exc
