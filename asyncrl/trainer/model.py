"""Model, optimizer and scheduler from the config (trainer/fsdp.py shards the model)."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from asyncrl import lora
from asyncrl.config.errors import ConfigError
from asyncrl.config.optim_args import optimizer_kwargs
from asyncrl.config.schema import Config, OptimizerName, TrainerConfig
from asyncrl.dtypes import torch_dtype
from asyncrl.model_kind import auto_model_class, non_text_prefixes
from asyncrl.registry import RegistryError, import_object

log = logging.getLogger(__name__)


def use_bf16(config: Config) -> bool:
    """trainer.bf16, else bf16 on a GPU unless trainer.fp16 asks for float16 (as TRL's default)."""
    t = config.trainer
    return bool(t.bf16) if t.bf16 is not None else torch.cuda.is_available() and not t.fp16


def mixed_precision_dtype(config: Config) -> torch.dtype | None:
    """The dtype forward and backward compute in over the float32 master weights (FSDP2's param_dtype): float16 with
    trainer.fp16, bfloat16 with bf16 on; None on the CPU, which trains as loaded."""
    if not torch.cuda.is_available():
        return None
    if config.trainer.fp16:
        return torch.float16
    return torch.bfloat16 if use_bf16(config) else None


def build_grad_scaler(config: Config) -> torch.amp.GradScaler:
    """trainer.fp16's loss scaler; disabled otherwise, where its calls pass straight through (the step unchanged).
    Every rank holds one: FSDP2's gradients are DTensors, whose overflow check all ranks share, so their scales move
    together."""
    return torch.amp.GradScaler("cuda", enabled=config.trainer.fp16)


def trainer_cpu_threads(config: Config, world: int, cores: int, backend: str) -> int:
    """trainer.cpu_threads, else the ``cores`` that a launched built-in server on the CPU leaves, split over the
    ``world`` ranks (at least one each). The embedded default on 2 cores, trainer at 2 threads beside the server's
    one: 2.35 s of fwd+bwd a step; at 1 thread: 0.75 s, and the server generated 1.8x faster. ``backend``: the
    plan's (RunPlan.server_backend)."""
    if config.trainer.cpu_threads is not None:
        return config.trainer.cpu_threads
    sv = config.server
    server_here = sv.launch and sv.device != "cuda" and backend == "builtin"
    return max(1, (cores - (sv.cpu_threads if server_here else 0)) // world)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def oversubscribed_cores(ranks: int, cores: int) -> str | None:
    """Why ``ranks`` trainer ranks on ``cores`` CPU cores are slow, if there are more ranks: they take turns on the
    cores, and each waits in every collective for the one that is not running."""
    if ranks <= cores:
        return None
    return (
        f"trainer.num_processes={ranks} is more than the {cores} CPU core(s) here: the ranks take turns on them and "
        f"each step waits for the slowest; set trainer.num_processes to {cores} or fewer"
    )


def use_cpu_threads(config: Config, world: int, backend: str) -> None:
    """Set this rank's torch threads when it trains on the CPU (see trainer_cpu_threads)."""
    if torch.cuda.is_available():
        return
    cores = available_cores()
    threads = trainer_cpu_threads(config, world, cores, backend)
    torch.set_num_threads(threads)
    log.info("trainer on the CPU: %d torch thread(s) per rank (%d cores, trainer.cpu_threads)", threads, cores)


def freeze_non_text(model: torch.nn.Module, freeze: bool = True) -> None:
    """model.freeze_vision_tower (``freeze``), the one place it is decided: requires_grad=False outside the text
    model (non_text_prefixes), so no gradients and no optimizer state; weight sync skips what this froze
    (weights/tensors.py::frozen_prefixes). ``freeze`` false leaves those modules training, and says so."""
    prefixes = non_text_prefixes(model)
    if not prefixes:
        return
    tower = [p for name, p in model.named_parameters() if name.startswith(prefixes)]
    for param in tower:
        param.requires_grad_(not freeze)
    how = "frozen" if freeze else "trained with the text model and synced (model.freeze_vision_tower=false)"
    names = ", ".join(p.rstrip(".") for p in prefixes)
    log.info("vision-language checkpoint: %s %s (%d parameters)", names, how, sum(p.numel() for p in tower))


def disable_dropout(model: torch.nn.Module) -> None:
    """model.disable_dropout: every torch.nn.Dropout's p and every attention module's ``attention_dropout`` (the
    float transformers' attention passes as its dropout in train() mode) set to 0. The model's config is left as
    it is, so saved checkpoints keep the checkpoint's own dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def cast_lm_head_to_fp32(model: torch.nn.Module, path: str) -> None:
    """model.cast_lm_head_to_fp32: the LM head's weights in float32 (its input is cast up as it enters: trainer/fsdp.py
    gathers it in float32 as a unit of its own, and the log-probabilities compute in the weight's dtype). A head tied
    to the input embeddings is refused, as TRL refuses it: casting it would cast the embeddings too."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        raise ConfigError(f"model.cast_lm_head_to_fp32=true needs an LM head of its own, and {path} ties it to the "
                          "input embeddings (tie_word_embeddings): drop model.cast_lm_head_to_fp32")  # fmt: skip
    head.float()


def use_tf32(config: Config) -> None:
    """trainer.tf32 for this rank's float32 matmuls and convolutions, as transformers' TrainingArguments sets it:
    true needs an Ampere or newer GPU, false is a no-op without one, null keeps torch's default."""
    tf32 = config.trainer.tf32
    if tf32 is None:
        return
    available = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    if tf32 and not available:
        raise ConfigError("trainer.tf32=true needs an NVIDIA GPU of the Ampere generation or newer, and this "
                          "trainer has none: drop trainer.tf32")  # fmt: skip
    if available:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def load_model(config: Config, path: str) -> torch.nn.Module:
    """The model at ``path``; with ``lora.enabled`` the base model wrapped with adapters (``path`` may then
    be an adapter checkpoint, whose base is model.name_or_path). A vision-language checkpoint loads whole (its
    checkpoints stay servable) with everything outside the text model frozen unless model.freeze_vision_tower is
    false. Every rank loads its policy here, so this is also where its matmul precision is set (trainer.tf32)."""
    use_tf32(config)
    m = config.model
    adapter_path = path if config.lora.enabled else None
    if lora.is_adapter_dir(path):
        if not config.lora.enabled:
            raise ValueError(
                f"{path} holds a LoRA adapter: resume it with the lora settings it was trained with "
                "(lora=default or lora.enabled=true)"
            )
        path = m.name_or_path
    source: dict[str, Any] = {"trust_remote_code": m.trust_remote_code}
    if m.revision and path == m.name_or_path:
        source["revision"] = m.revision
    kwargs = {
        "dtype": torch_dtype(m.dtype) or "auto",
        "attn_implementation": m.attn_implementation,
        **source,
        **m.model_init_kwargs,
    }
    model = auto_model_class(path, **source).from_pretrained(path, **kwargs)  # its config as is: a saved model
    # keeps the source's use_cache (the packed forward passes use_cache=False itself)
    freeze_non_text(model, m.freeze_vision_tower)
    if m.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model, path)
    if m.disable_dropout:
        disable_dropout(model)
    if config.trainer.gradient_checkpointing:
        kwargs = {"use_reentrant": False, **config.trainer.gradient_checkpointing_kwargs}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return lora.wrap(config, model, adapter_path) if adapter_path is not None else model


def _adamw(t: TrainerConfig, params: list[torch.nn.Parameter], **extra: Any) -> torch.optim.Optimizer:
    betas = (t.adam_beta1, t.adam_beta2)
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=betas, eps=t.adam_epsilon, weight_decay=t.weight_decay,
                             **extra)  # fmt: skip


def _rate_and_decay(
    cls: type[torch.optim.Optimizer], t: TrainerConfig, params: list[torch.nn.Parameter], **extra: Any
) -> torch.optim.Optimizer:
    return cls(params, lr=t.learning_rate, weight_decay=t.weight_decay, **extra)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    OptimizerName.adamw_torch: _adamw,
    OptimizerName.adamw_torch_fused: partial(_adamw, fused=True),
    OptimizerName.sgd: partial(_rate_and_decay, torch.optim.SGD),
    OptimizerName.adagrad: partial(_rate_and_decay, torch.optim.Adagrad),
    OptimizerName.rmsprop: partial(_rate_and_decay, torch.optim.RMSprop),
}
"""trainer.optim -> its optimizer over the trainable parameters, with the arguments transformers' Trainer gives it
(trainer.optim_args' keywords too), in one parameter group: weight_decay applies to every trainable parameter
(transformers' Trainer exempts biases and norms; a trainer.optimizer_factory can). Adagrad's and RMSprop's eps are
torch's defaults (1e-10, 1e-8), as transformers leaves them, unless optim_args sets one."""

FACTORY_CALLS = {
    "optimizer_factory": "function(named_parameters, config)",
    "scheduler_factory": "function(optimizer, num_training_steps)",
}
"""trainer.optimizer_factory and scheduler_factory -> how the trainer calls the function each names."""


def resolve_factory(config: Config, key: str) -> Callable[..., Any]:
    """The function trainer.<key> names, importable and taking the two arguments it is given, or one ConfigError
    naming the key: what can be checked before the function runs."""
    path = getattr(config.trainer, key)
    try:
        factory = import_object(path)
    except RegistryError as exc:
        raise ConfigError(f"trainer.{key}: {exc}") from exc
    try:
        inspect.signature(factory).bind(None, None)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"trainer.{key}: '{path}' cannot be called as {FACTORY_CALLS[key]} ({exc}): name a function "
                          "of those two arguments") from exc  # fmt: skip
    return factory


def _factory_optimizer(config: Config, named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """trainer.optimizer_factory's optimizer, refused in one line unless it is a torch optimizer over the parameters
    it was given: over copies or local shards (DTensor.to_local) it would step tensors the model does not use."""
    path = config.trainer.optimizer_factory
    optimizer = resolve_factory(config, "optimizer_factory")(named, config)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"trainer.optimizer_factory: '{path}' returned a {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer: return one built over the parameters it is given")  # fmt: skip
    given = {id(param) for _, param in named}
    if any(id(param) not in given for group in optimizer.param_groups for param in group["params"]):
        raise ConfigError(f"trainer.optimizer_factory: '{path}' returned an optimizer over tensors it was not given "
                          "(copies, or DTensor.to_local() shards): build it over the named_parameters' parameters "
                          "as they are")  # fmt: skip
    return optimizer


def _factory_scheduler(config: Config, optimizer: torch.optim.Optimizer) -> Any:
    """trainer.scheduler_factory's schedule over trainer.max_steps, refused in one line unless it is a schedule of
    ``optimizer`` that the loop can step without a metric (each optimizer step calls scheduler.step())."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    path = config.trainer.scheduler_factory
    scheduler = resolve_factory(config, "scheduler_factory")(optimizer, config.trainer.max_steps)
    if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, ReduceLROnPlateau):
        raise ConfigError(f"trainer.scheduler_factory: '{path}' returned a {type(scheduler).__name__}, not a "
                          "torch.optim.lr_scheduler.LRScheduler stepped without a metric (e.g. LambdaLR)")  # fmt: skip
    if scheduler.optimizer is not optimizer:
        raise ConfigError(f"trainer.scheduler_factory: '{path}' returned the schedule of another optimizer: build "
                          "it over the optimizer it is given")  # fmt: skip
    return scheduler


def build_scheduler(config: Config, optimizer: torch.optim.Optimizer) -> Any:
    """trainer.scheduler_factory's schedule, else transformers' trainer.lr_scheduler_type over trainer.max_steps
    optimizer steps."""
    t = config.trainer
    if t.scheduler_factory is not None:
        return _factory_scheduler(config, optimizer)
    from transformers import get_scheduler

    return get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=t.warmup_steps,
                         num_training_steps=max(t.max_steps, 1),
                         scheduler_specific_kwargs=dict(t.lr_scheduler_kwargs))  # fmt: skip


def build_optimizer(config: Config, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over the trainable parameters (after FSDP2 sharded them: DTensors) and its schedule."""
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    t = config.trainer
    if t.optimizer_factory is not None:
        optimizer = _factory_optimizer(config, named)
    else:
        optimizer = OPTIMIZERS[t.optim](t, [param for _, param in named], **optimizer_kwargs(t))
    return optimizer, build_scheduler(config, optimizer)
