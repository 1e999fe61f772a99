"""TRL's optimizers=(optimizer, scheduler) as trainer.optimizer_factory and trainer.scheduler_factory: the factories
build over FSDP2's sharded parameters, train, and resume from a checkpoint; what they replace, and factories that
cannot give the trainer an optimizer and a schedule, fail in one line. Every trainer.optim survives the warm-up."""

from __future__ import annotations

import pytest
import torch
from sharded import save, sharded
from transformers import AutoTokenizer

from asyncrl.config.compose import compose, to_config
from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import OptimizerName
from asyncrl.trainer import fsdp
from asyncrl.trainer.checkpoint import TrainerState, load_checkpoint
from asyncrl.trainer.memory import warm_up
from asyncrl.trainer.model import build_optimizer, load_model

IDS = torch.tensor([[4, 30, 31, 32, 5, 6, 40, 41]])
HERE = __name__


def no_decay_on_norms(named_parameters, config):
    """transformers' Trainer's two groups by name: no weight decay on the norms (Qwen3 has no biases)."""
    t = config.trainer
    decayed = [param for name, param in named_parameters if "norm" not in name]
    norms = [param for name, param in named_parameters if "norm" in name]
    groups = [{"params": decayed, "weight_decay": t.weight_decay}, {"params": norms, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.learning_rate)


def halve_midway(optimizer, num_training_steps):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=num_training_steps // 2, gamma=0.5)


def one_argument(named_parameters):
    return torch.optim.SGD([param for _, param in named_parameters])


def not_an_optimizer(named_parameters, config):
    return [param for _, param in named_parameters]


def over_copies(named_parameters, config):
    return torch.optim.SGD([param.detach().clone().requires_grad_() for _, param in named_parameters], lr=0.1)


def on_plateau(optimizer, num_training_steps):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def of_another_optimizer(optimizer, num_training_steps):
    return torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), step_size=1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def factory_config(model_dir, *extra: str):
    return to_config(compose([f"model.name_or_path={model_dir}", f"trainer.optimizer_factory={HERE}:no_decay_on_norms",
                              f"trainer.scheduler_factory={HERE}:halve_midway", "trainer.max_steps=4",
                              "trainer.learning_rate=1e-3", "trainer.weight_decay=0.1", *extra]))  # fmt: skip


def test_the_factories_optimizer_steps_the_sharded_parameters_on_their_schedule(random_tiny_model_dir, one_rank):
    """The optimizer factory gets the named DTensors and groups them by name; the schedule's factory gets
    trainer.max_steps (4): the learning rate halves after 2 steps."""
    config = factory_config(random_tiny_model_dir)
    model, optimizer, scheduler = sharded(config, load_model(config, str(random_tiny_model_dir)))
    norms = {id(param) for name, param in model.named_parameters() if "norm" in name}
    decayed, undecayed = optimizer.param_groups
    assert norms and {id(param) for param in undecayed["params"]} == norms
    assert (decayed["weight_decay"], undecayed["weight_decay"]) == (0.1, 0.0)
    assert all(type(param).__name__ == "DTensor" for group in optimizer.param_groups for param in group["params"])
    before = [param.detach().full_tensor().clone() for param in model.parameters()]
    rates = []
    for _ in range(4):
        train_step(model, optimizer, scheduler)
        rates.append(scheduler.get_last_lr()[0])
    assert rates == pytest.approx([1e-3, 5e-4, 5e-4, 2.5e-4])
    after = [param.detach().full_tensor() for param in model.parameters()]
    assert all(not torch.equal(old, new) for old, new in zip(before, after, strict=True))


def test_a_scheduler_factory_schedules_trainer_optims_optimizer():
    config = to_config(compose(["trainer.optim=sgd", f"trainer.scheduler_factory={HERE}:halve_midway",
                                "trainer.max_steps=2", "trainer.learning_rate=0.1"]))  # fmt: skip
    optimizer, scheduler = build_optimizer(config, torch.nn.Linear(2, 2))
    assert type(optimizer) is torch.optim.SGD
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.05])


def test_a_checkpoint_resumes_the_factories_optimizer_and_schedule(random_tiny_model_dir, one_rank, tmp_path):
    """Rebuilt as a resumed rank builds it (trainer/distributed.py build_sharded) and restored from the checkpoint,
    the factories' optimizer and schedule take the next step exactly as the ones that wrote it."""
    config = factory_config(random_tiny_model_dir)
    model, optimizer, scheduler = sharded(config, load_model(config, str(random_tiny_model_dir)))
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    state = TrainerState(step=2, model_version=2, prompt_index=0, prompts_consumed=0, extra={}, done_after_index=[])
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model_dir)
    path = save(tmp_path, state, model, tokenizer, optimizer, scheduler, one_rank)
    resumed, resumed_optimizer, resumed_scheduler = sharded(config, load_model(config, str(path)))
    fsdp.load_sharded(path, resumed, resumed_optimizer)
    assert load_checkpoint(path, resumed_scheduler).step == 2
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr() == pytest.approx([5e-4, 5e-4])  # both groups
    assert [g["weight_decay"] for g in resumed_optimizer.param_groups] == [0.1, 0.0]
    train_step(model, optimizer, scheduler)
    train_step(resumed, resumed_optimizer, resumed_scheduler)
    for old, new in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(new.detach().full_tensor(), old.detach().full_tensor(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("factory", "line"),
    [
        ("optimizer_factory=no_such_pkg.optimizers:build", "trainer.optimizer_factory: cannot import module "
         "'no_such_pkg.optimizers' for 'no_such_pkg.optimizers:build': No module named 'no_such_pkg'"),
        (f"optimizer_factory={HERE}:missing", f"trainer.optimizer_factory: module '{HERE}' has no attribute 'missing' "
         f"(from '{HERE}:missing')"),
        (f"optimizer_factory={HERE}:one_argument", f"trainer.optimizer_factory: '{HERE}:one_argument' cannot be called "
         "as function(named_parameters, config) (too many positional arguments): name a function of those two "
         "arguments"),
        (f"optimizer_factory={HERE}:IDS", f"trainer.optimizer_factory: '{HERE}:IDS' cannot be called as "
         "function(named_parameters, config) (tensor([[ 4, 30, 31, 32,  5,  6, 40, 41]]) is not a callable object): "
         "name a function of those two arguments"),
        (f"optimizer_factory={HERE}:not_an_optimizer", f"trainer.optimizer_factory: '{HERE}:not_an_optimizer' "
         "returned a list, not a torch.optim.Optimizer: return one built over the parameters it is given"),
        (f"optimizer_factory={HERE}:over_copies", f"trainer.optimizer_factory: '{HERE}:over_copies' returned an "
         "optimizer over tensors it was not given (copies, or DTensor.to_local() shards): build it over the "
         "named_parameters' parameters as they are"),
        (f"scheduler_factory={HERE}:on_plateau", f"trainer.scheduler_factory: '{HERE}:on_plateau' returned a "
         "ReduceLROnPlateau, not a torch.optim.lr_scheduler.LRScheduler stepped without a metric (e.g. LambdaLR)"),
        (f"scheduler_factory={HERE}:of_another_optimizer", f"trainer.scheduler_factory: '{HERE}:of_another_optimizer' "
         "returned the schedule of another optimizer: build it over the optimizer it is given"),
    ],
)  # fmt: skip
def test_a_factory_that_gives_the_trainer_no_optimizer_or_schedule_fails_in_one_line(factory, line):
    config = to_config(compose([f"trainer.{factory}"]))
    with pytest.raises(ConfigError) as error:
        build_optimizer(config, torch.nn.Linear(2, 2))
    assert str(error.value) == line


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["trainer.optimizer_factory=pkg.mod:f", "trainer.optim=sgd"],
         "trainer.optim=sgd does nothing beside trainer.optimizer_factory=pkg.mod:f, whose function replaces it: drop "
         "trainer.optim"),
        (["trainer.optimizer_factory=pkg.mod:f", "trainer.optim_args='amsgrad=true'"],
         "trainer.optim_args='amsgrad=true' does nothing beside trainer.optimizer_factory=pkg.mod:f, whose function "
         "replaces it: drop trainer.optim_args"),
        (["trainer.scheduler_factory=pkg.mod:f", "trainer.lr_scheduler_type=cosine"],
         "trainer.lr_scheduler_type=cosine does nothing beside trainer.scheduler_factory=pkg.mod:f, whose function "
         "replaces it: drop trainer.lr_scheduler_type"),
        (["trainer.scheduler_factory=pkg.mod:f", "+trainer.lr_scheduler_kwargs={min_lr_rate: 0.1}"],
         "trainer.lr_scheduler_kwargs={'min_lr_rate': 0.1} does nothing beside trainer.scheduler_factory=pkg.mod:f, "
         "whose function replaces it: drop trainer.lr_scheduler_kwargs"),
        (["trainer.scheduler_factory=pkg.mod:f", "trainer.warmup_steps=5"],
         "trainer.warmup_steps=5 does nothing beside trainer.scheduler_factory=pkg.mod:f, whose function replaces it: "
         "drop trainer.warmup_steps"),
        (["trainer.scheduler_factory=pkg.mod:f", "trainer.max_steps=-1"],
         "trainer.scheduler_factory=pkg.mod:f is given the run's optimizer steps, which an epoch-based run cannot know "
         "in advance: set trainer.max_steps too"),
    ],
)  # fmt: skip
def test_what_a_factory_replaces_is_refused_beside_it_when_the_config_is_composed(overrides, line):
    with pytest.raises(ConfigError) as error:
        to_config(compose(overrides))
    assert str(error.value) == line


@pytest.mark.parametrize("optim", list(OptimizerName))
def test_every_trainer_optim_leaves_the_weights_through_the_warm_up_step(optim):
    """The GPU warm-up steps the optimizer at learning rate 0 on zeroed gradients (trainer/memory.py): no optimizer
    offered may move a weight there, weight decay included; the same step at the real rate does."""
    config = to_config(compose([f"trainer.optim={optim}", "trainer.learning_rate=0.1", "trainer.weight_decay=0.1"]))
    model = torch.nn.Linear(3, 2)
    optimizer, _ = build_optimizer(config, model)
    before = [param.detach().clone() for param in model.parameters()]

    def step() -> None:
        model(torch.ones(1, 3)).sum().backward()

    warm_up(step, model, optimizer)
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
    step()
    optimizer.step()
    assert all(not torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
