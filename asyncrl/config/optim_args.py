"""trainer.optim_args, transformers' comma-separated ``key=value`` string for the optimizer, read into the keywords
of trainer.optim's optimizer (trainer/model.py builds it with them) and checked when the config is composed
(config/validate.py).

transformers parses the same string and hands each optimizer the keys it knows, as floats or booleans, dropping the
rest: its SGD takes momentum, dampening, weight_decay and nesterov, Adagrad lr_decay, weight_decay and eps, RMSprop
momentum, alpha, eps, weight_decay and centered, AdamW none. Here a key the optimizer does not take is refused rather
than dropped, AdamW takes ``amsgrad`` (a torch AdamW keyword transformers' Trainer never passes), and what has a key
of its own (the learning rate, the weight decay, AdamW's betas and epsilon) is set there, not twice.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import OptimizerName, TrainerConfig

OPTIM_ARGS: dict[str, dict[str, type]] = {
    OptimizerName.adamw_torch: {"amsgrad": bool},
    OptimizerName.adamw_torch_fused: {"amsgrad": bool},
    OptimizerName.sgd: {"momentum": float, "dampening": float, "nesterov": bool},
    OptimizerName.adagrad: {"lr_decay": float, "eps": float},
    OptimizerName.rmsprop: {"momentum": float, "alpha": float, "eps": float, "centered": bool},
}
"""trainer.optim -> the optim_args keys its torch optimizer takes, with the type each value is read as."""
NON_NEGATIVE = ("momentum", "lr_decay", "alpha", "eps")
"""The keys whose negative values torch's optimizers refuse as they are built, in the trainer: refused here first."""
OWN_KEYS = (
    "the learning rate, weight decay and AdamW's betas and epsilon are trainer.learning_rate, trainer.weight_decay, "
    "trainer.adam_beta1, trainer.adam_beta2 and trainer.adam_epsilon"
)
BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
EXAMPLE = "e.g. trainer.optim_args='momentum=0.9,nesterov=true' with trainer.optim=sgd"


def optimizer_kwargs(t: TrainerConfig) -> dict[str, Any]:
    """The keywords trainer.optim_args gives trainer.optim's optimizer, each read as the type it takes; ConfigError
    in one line for a malformed string, a key the optimizer does not take or a value it cannot be."""
    if not t.optim_args:
        return {}
    where, accepted = f"trainer.optim_args={t.optim_args!r}", OPTIM_ARGS[t.optim]
    kwargs: dict[str, Any] = {}
    for pair in t.optim_args.replace(" ", "").split(","):
        key, equals, text = pair.partition("=")
        if not key or not equals:
            raise ConfigError(f"{where}: expected comma-separated key=value pairs, {EXAMPLE}")
        if key not in accepted:
            takes = ", ".join(accepted)
            raise ConfigError(f"{where}: trainer.optim={t.optim} takes {takes} here, not {key} ({OWN_KEYS})")
        if key in kwargs:
            raise ConfigError(f"{where}: {key} is given twice")
        kwargs[key] = _value(where, key, text, accepted[key])
    _check_ranges(where, kwargs)
    return kwargs


def _value(where: str, key: str, text: str, kind: type) -> float | bool:
    """``text`` as ``kind``: a float, or a boolean spelled true/false (also 1/0, yes/no, as transformers reads them)."""
    if kind is bool:
        if text.lower() not in BOOLEANS:
            raise ConfigError(f"{where}: {key}={text} must be true or false")
        return BOOLEANS[text.lower()]
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: {key}={text} must be a number") from None


def _check_ranges(where: str, kwargs: dict[str, Any]) -> None:
    """What torch's optimizers refuse when they are built, in the trainer: said here, before anything starts."""
    for key in NON_NEGATIVE:
        if kwargs.get(key, 0.0) < 0:
            raise ConfigError(f"{where}: {key}={kwargs[key]} must be >= 0")
    if kwargs.get("nesterov") and (kwargs.get("momentum", 0.0) <= 0 or kwargs.get("dampening", 0.0) != 0):
        raise ConfigError(f"{where}: nesterov=true needs momentum > 0 and dampening=0 (torch's SGD)")
