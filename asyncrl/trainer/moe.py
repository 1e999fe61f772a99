"""Mixture-of-Experts: the router's load-balancing loss, added to the policy loss with model.router_aux_loss_coef.

transformers' MoE models return it as ``aux_loss`` when forwarded with ``output_router_logits=True``, computed over
every token the forward saw. On a packed row that is the row's forwarded tokens: a prompt shared by a group's
rollouts in a tree row is routed, and counted, once; flat rows count it once per rollout, as unpacked training does.
Each micro-batch adds ``coef x aux_loss / micro-batches of the step``, so a step adds the coefficient times the mean
over its rows (the step's loss is a sum of micro-batch shares).
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config


def is_moe(model_config: Any) -> bool:
    """Whether the (text) model routes tokens to experts and declares a load-balancing coefficient."""
    text = model_config.get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    return bool(experts) and hasattr(text, "router_aux_loss_coef")


def router_aux_coef(config: Config, model_config: Any) -> float:
    """model.router_aux_loss_coef, else the model config's own value; 0 for dense models. Set on a dense model it
    is a config error (a coefficient that would silently do nothing)."""
    coef = config.model.router_aux_loss_coef
    if not is_moe(model_config):
        if coef is not None:
            raise ConfigError(
                f"model.router_aux_loss_coef={coef} is set, but {config.model.name_or_path} is not a "
                "Mixture-of-Experts model: remove the override"
            )
        return 0.0
    return float(model_config.get_text_config().router_aux_loss_coef if coef is None else coef)


def check_router_aux_coef(config: Config) -> float:
    """Before the server starts: the coefficient the run will use, from the checkpoint's config alone."""
    from transformers import AutoConfig

    m = config.model
    if m.router_aux_loss_coef is not None and m.router_aux_loss_coef < 0:
        raise ConfigError(f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be >= 0 (0 disables)")
    model_config = AutoConfig.from_pretrained(
        m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code
    )
    return router_aux_coef(config, model_config)
