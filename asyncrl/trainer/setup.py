"""Everything that can be checked before the server starts: data, tokenizer, components, picklability."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncrl.components import Components
from asyncrl.config.schema import Config
from asyncrl.prompts import load_tokenizer
from asyncrl.registry import import_object
from asyncrl.run_plan import RunPlan


@dataclass
class Prepared:
    dataset: Any
    eval_dataset: Any | None
    tokenizer: Any
    plan: RunPlan
    """What the run decided once: its components and its flow rules."""
    loop_cls: type

    @property
    def components(self) -> Components:
        """The plan's: the trainer runs them, and the worker gets the rewards and estimator in its spec."""
        return self.plan.components

    def total_prompts(self, config: Config) -> int | None:
        """Prompts in the whole run when it stops on epochs; None when max_steps decides."""
        if config.trainer.max_steps > 0:
            return None
        return math.ceil(config.trainer.num_train_epochs * len(self.dataset))


def check_model_path(config: Config) -> None:
    """model.name_or_path is a Hub id or a local model directory whose weights are whole: a missing directory is
    otherwise reported as an invalid Hub repository id, and a truncated file only once the server loads it."""
    from pathlib import Path

    from asyncrl.config.errors import ConfigError
    from asyncrl.hub import is_hub_id
    from asyncrl.trainer.checkpoint import damaged_weights

    name = config.model.name_or_path
    path = Path(name).expanduser()
    if path.is_dir():
        damaged = damaged_weights(path)
        if damaged:
            raise ConfigError(f"model.name_or_path={name}: {damaged}; copy the model again")
    elif not is_hub_id(name):
        raise ConfigError(f"model.name_or_path={name}: no such directory (give a model directory in "
                          "save_pretrained layout, or a Hub id such as Qwen/Qwen3-4B)")  # fmt: skip


def check_tf32_device(config: Config) -> None:
    """trainer.tf32=true on a machine without a GPU is refused before the server starts (transformers refuses it
    too); the trainer checks the GPU's generation when it loads the model (trainer/model.py use_tf32), as reading it
    here would start CUDA in the launching process."""
    import torch

    from asyncrl.config.errors import ConfigError

    if config.trainer.tf32 and not torch.cuda.is_available():
        raise ConfigError("trainer.tf32=true: TF32 is a mode of NVIDIA GPUs (Ampere or newer) and this machine has "
                          "none (the CPU trains in IEEE float32): drop trainer.tf32")  # fmt: skip


def prepare(plan: RunPlan) -> Prepared:
    """Everything the run needs besides the model and the server, checked before the server starts
    (``plan``: asyncrl.plan.assemble.plan_run)."""
    from asyncrl.data import load_eval_prompts, load_train_prompts
    from asyncrl.rollout.environments import check_routing, environment_rows
    from asyncrl.rollout.loop import AsyncRolloutLoop
    from asyncrl.trainer.moe import check_router_aux_coef

    config = plan.config
    check_model_path(config)
    if config.data.path is None:
        dataset = environment_rows()  # validated: a single environment supplies each prompt from reset()
    else:
        dataset = load_train_prompts(config)  # data.streaming: a PromptStream, read by the worker
    eval_dataset = load_eval_prompts(config)
    loop_cls = import_object(config.rollout.loop_cls)
    if not (isinstance(loop_cls, type) and issubclass(loop_cls, AsyncRolloutLoop)):
        raise TypeError(f"rollout.loop_cls={config.rollout.loop_cls} is not a subclass of AsyncRolloutLoop")
    check_components_pickle(plan.components)
    conversational = check_prompt_forms(config, dataset, eval_dataset)
    tokenizer = load_tokenizer(config)
    check_agents(config, tokenizer, conversational)
    check_reward_model_tokenizers(config, plan.components, conversational)
    check_router_aux_coef(config)
    check_tf32_device(config)
    check_routing(dataset, config.rollout.environment_factory)
    check_images(config, dataset, eval_dataset)
    return Prepared(dataset, eval_dataset, tokenizer, plan, loop_cls)


def check_components_pickle(components: Components) -> None:
    """The rewards and the estimator cross to the rollout worker pickled (its spec): each must, named if not."""
    from asyncrl.rollout.spawn import check_picklable

    for source in components.rewards:
        check_picklable(source.fn, f"reward function '{source.name}'")
    check_picklable(components.advantage, "advantage estimator (advantage.name)")


def check_reward_model_tokenizers(config: Config, components: Components, conversational: bool) -> None:
    """Each reward model's tokenizer loads, with a chat template for conversational prompts, and its own code (if any)
    is trusted (its config was checked with the plan: plan/assemble.py)."""
    from asyncrl.rewards.classifier import check_tokenizer
    from asyncrl.rewards.reward_model import RewardModel

    for index, source in enumerate(components.rewards):
        if isinstance(source.fn, RewardModel):
            check_tokenizer(source.fn.options, f"reward_funcs[{index}]", conversational,
                            trust_remote_code=config.model.trust_remote_code)  # fmt: skip


def check_prompt_forms(config: Config, dataset: Any, eval_dataset: Any | None) -> bool:
    """Standard (plain-text) prompts have no chat template to render tools or a tool loop's turns with; whether any
    of the datasets is conversational (and so needs the tokenizer's chat template)."""
    from asyncrl.config.errors import ConfigError
    from asyncrl.data import standard_prompts

    standard = standard_prompts(dataset)
    if standard and (config.rollout.tools or config.rollout.environment_factory is not None):
        raise ConfigError(f"data.path={config.data.path} has standard (plain-text) prompts, which take no tools or "
                          "environments (rollout.tools, rollout.environment_factory): give conversational prompts "
                          "(a list of {role, content} messages per row) or drop those keys")  # fmt: skip
    return not standard or (eval_dataset is not None and not standard_prompts(eval_dataset))


def check_images(config: Config, dataset: Any, eval_dataset: Any | None) -> None:
    """Prompts with images need a vision-language checkpoint with an image processor (on any number of trainer ranks:
    trainer/distributed.py::pair_images)."""
    from asyncrl.config.errors import ConfigError
    from asyncrl.data import has_images
    from asyncrl.model_kind import is_vision_language
    from asyncrl.rollout.images import checkpoint_config, image_processing

    sources = [("data.path", config.data.path, dataset), ("data.eval_path", config.data.eval_path, eval_dataset)]
    found = [(key, path) for key, path, rows in sources if rows is not None and path is not None and has_images(rows)]
    if not found:
        return
    key, path = found[0]
    m = config.model
    model_config = checkpoint_config(config)
    if not is_vision_language(model_config):
        raise ConfigError(f"{key}={path} has images, and model.name_or_path={m.name_or_path} is a text-only "
                          "checkpoint: give a vision-language one (e.g. Qwen/Qwen3.5-2B) or a dataset without "
                          "images")  # fmt: skip
    try:
        image_processing(config, model_config)
    except (OSError, ImportError, ValueError) as error:
        first = str(error).strip().splitlines()[0]
        message = f"model.name_or_path={m.name_or_path}: cannot process the images of {key} ({first})"
        raise ConfigError(message) from error


def check_agents(config: Config, tokenizer: Any, conversational: bool = True) -> None:
    """Tools and environments: picklable, schemas buildable; the chat template per rollout.chat_template (required
    for ``conversational`` prompts), and a warning when it is still not prefix-preserving for a tool turn (every turn
    would then fork a new sample)."""
    import warnings

    from asyncrl.rollout.environments import load_factories, load_tools
    from asyncrl.rollout.spawn import check_picklable
    from asyncrl.rollout.templates import FAMILIES, use_chat_template
    from asyncrl.rollout.tools import template_preserves_prefix, tool_schemas

    tools = load_tools(list(config.rollout.tools))
    for fn in tools:
        check_picklable(fn, f"tool {fn.__name__} (rollout.tools)")
    tool_schemas(tools)
    for name, factory in load_factories(config.rollout.environment_factory).items():
        check_picklable(factory, f"environment factory {name or ''} (rollout.environment_factory)")
    agentic = bool(tools or config.rollout.environment_factory)
    kwargs = config.sampling.chat_template_kwargs
    use_chat_template(tokenizer, config.rollout.chat_template, agentic=agentic, chat_template_kwargs=kwargs,
                      model=config.model.name_or_path)  # fmt: skip
    if tokenizer.chat_template is None and conversational:
        from asyncrl.config.errors import ConfigError

        raise ConfigError(f"model.name_or_path={config.model.name_or_path}: its tokenizer has no chat template "
                          "(no chat_template.jinja, nor chat_template in tokenizer_config.json) to render the "
                          "conversational prompts: give one with rollout.chat_template=PATH.jinja")  # fmt: skip
    if agentic and not template_preserves_prefix(tokenizer, kwargs):
        warnings.warn(
            f"the chat template of {config.model.name_or_path} re-renders earlier turns when a tool turn is "
            "appended: multi-turn rollouts will fork into several samples (see rollout/fork_frac); use a "
            "prefix-preserving training template (rollout.chat_template=auto swaps one in for the families "
            f"{[f.name for f in FAMILIES]}, or give a .jinja file)", stacklevel=2,
        )  # fmt: skip
