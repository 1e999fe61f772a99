"""trainer.optim_args: transformers' key=value string read into the chosen optimizer's keywords, typed; anything the
optimizer does not take, or cannot be, fails in one line when the config is composed."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.optim_args import NON_NEGATIVE, OPTIM_ARGS, optimizer_kwargs
from asyncrl.trainer.model import OPTIMIZERS


@pytest.mark.parametrize(
    ("optim", "text", "kwargs"),
    [
        ("sgd", "momentum=0.9, nesterov=true", {"momentum": 0.9, "nesterov": True}),
        ("sgd", "momentum=0.5,dampening=0.1,nesterov=0", {"momentum": 0.5, "dampening": 0.1, "nesterov": False}),
        ("adamw_torch", "amsgrad=True", {"amsgrad": True}),
        ("adamw_torch_fused", "amsgrad=no", {"amsgrad": False}),
        ("adagrad", "lr_decay=0.01,eps=1e-10", {"lr_decay": 0.01, "eps": 1e-10}),
        (
            "rmsprop",
            "momentum=0.9,alpha=0.95,eps=1e-6,centered=yes",
            {"momentum": 0.9, "alpha": 0.95, "eps": 1e-6, "centered": True},
        ),
        ("sgd", None, {}),
    ],
)
def test_optim_args_become_typed_keywords_of_the_optimizer(optim, text, kwargs):
    quoted = "null" if text is None else f"'{text}'"
    config = to_config(compose([f"trainer.optim={optim}", f"trainer.optim_args={quoted}"]))
    assert optimizer_kwargs(config.trainer) == kwargs


OWN_KEYS = (
    "the learning rate, weight decay and AdamW's betas and epsilon are trainer.learning_rate, trainer.weight_decay, "
    "trainer.adam_beta1, trainer.adam_beta2 and trainer.adam_epsilon"
)


@pytest.mark.parametrize(
    ("optim", "text", "line"),
    [
        ("sgd", "momentum", "expected comma-separated key=value pairs, e.g. trainer.optim_args='momentum=0.9,"
                            "nesterov=true' with trainer.optim=sgd"),
        ("sgd", "momentum=0.9,", "expected comma-separated key=value pairs, e.g. trainer.optim_args='momentum=0.9,"
                                 "nesterov=true' with trainer.optim=sgd"),
        ("sgd", "weight_decay=0.1", f"trainer.optim=sgd takes momentum, dampening, nesterov here, not weight_decay "
                                    f"({OWN_KEYS})"),
        ("adamw_torch", "momentum=0.9", f"trainer.optim=adamw_torch takes amsgrad here, not momentum ({OWN_KEYS})"),
        ("sgd", "momentum=fast", "momentum=fast must be a number"),
        ("sgd", "nesterov=maybe", "nesterov=maybe must be true or false"),
        ("sgd", "momentum=0.9,momentum=0.5", "momentum is given twice"),
        ("sgd", "momentum=-0.5", "momentum=-0.5 must be >= 0"),
        ("adagrad", "momentum=0.9", f"trainer.optim=adagrad takes lr_decay, eps here, not momentum ({OWN_KEYS})"),
        ("rmsprop", "nesterov=true", f"trainer.optim=rmsprop takes momentum, alpha, eps, centered here, not nesterov "
                                     f"({OWN_KEYS})"),
        ("adagrad", "lr_decay=-0.1", "lr_decay=-0.1 must be >= 0"),
        ("rmsprop", "alpha=-0.9", "alpha=-0.9 must be >= 0"),
        ("rmsprop", "eps=-1e-08", "eps=-1e-08 must be >= 0"),
        ("sgd", "nesterov=true", "nesterov=true needs momentum > 0 and dampening=0 (torch's SGD)"),
        ("sgd", "momentum=0.9,dampening=0.1,nesterov=true", "nesterov=true needs momentum > 0 and dampening=0 "
                                                            "(torch's SGD)"),
    ],
)  # fmt: skip
def test_optim_args_the_optimizer_cannot_take_fail_in_one_line(optim, text, line):
    with pytest.raises(ConfigError) as error:
        to_config(compose([f"trainer.optim={optim}", f"trainer.optim_args='{text}'"]))
    assert str(error.value) == f"trainer.optim_args={text!r}: {line}"


@pytest.mark.parametrize(
    ("optim", "key"), [(o, k) for o, keys in OPTIM_ARGS.items() for k in keys if k in NON_NEGATIVE]
)
def test_the_negative_values_refused_at_compose_are_those_torch_refuses(optim, key):
    """Each optimizer's key refused below 0 when the config is composed would have failed later, in the trainer, as
    torch's optimizer was built; at 0 both take it."""
    config = to_config(compose([f"trainer.optim={optim}"]))
    param = [torch.nn.Parameter(torch.zeros(2))]
    OPTIMIZERS[optim](config.trainer, param, **{key: 0.0})
    with pytest.raises(ValueError):
        OPTIMIZERS[optim](config.trainer, param, **{key: -0.1})
