"""Plan a run: the checks that need more than the config's own fields, then each derived decision, made once.

config/ composes the config and checks it on its own fields (config/validate.py). The checks here need the
flow rules, the servers' and the trainer's backends, tools and environments, or the built components, so they
sit above all of those. Each raises ``ConfigError`` naming the key, its value and the override that fixes it;
``build_plan`` runs them all and returns the frozen ``RunPlan`` (a misspelt component or option fails there,
before the server is launched).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from asyncrl.components import Components
from asyncrl.config.compose import to_config
from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config, LoraSync, LrSchedulerType, ModelDtype, ModelImpl, ServerBackend
from asyncrl.flow import FlowControl
from asyncrl.plan.decide import (
    adapter_sync_by_config,
    max_model_len,
    measured_split_pending,
    needed_gpus,
    resolve_backend,
    runtime_lora,
    serves_on_gpu,
    serving_dtype,
    split_gpus,
    visible_gpus,
    weight_transfer,
)
from asyncrl.run_plan import RunPlan, ServerCommand, ranks_per_node, world_size
from asyncrl.serving.choice import server_command
from asyncrl.serving.command import VLLM_LORA_RANKS

if TYPE_CHECKING:
    from asyncrl.footprint import TrainerMemory

log = logging.getLogger(__name__)


def check_synchronous_sync(config: Config, flow: FlowControl) -> None:
    if flow.synchronous and config.staleness.weight_sync_steps != 1:
        raise ConfigError(
            f"staleness.max_staleness=0 is synchronous GRPO: every step trains on the weights just synced, so "
            f"staleness.weight_sync_steps={config.staleness.weight_sync_steps} must be 1"
        )


def check_samples_per_step_mode(config: Config, flow: FlowControl) -> None:
    """A synchronous step trains the whole batch generated for it: with a fixed number of samples per step, that
    batch is whole groups (``FlowControl.batch_groups``), as TRL's generation batch is."""
    n, g = config.trainer.samples_per_step, flow.num_generations
    if n is not None and flow.synchronous and n % g:
        fits = max(g, n - n % g)
        raise ConfigError(
            f"trainer.samples_per_step={n} with staleness.max_staleness=0 must be a multiple of sampling."
            f"num_generations={g} (a synchronous step trains whole groups): try trainer.samples_per_step={fits}"
        )


def check_adapter_slots(config: Config, flow: FlowControl) -> None:
    lora, sv = config.lora, config.server
    needed = flow.adapter_slots
    if lora.enabled and lora.sync == LoraSync.adapter and sv.max_loras is not None and sv.max_loras < needed:
        raise ConfigError(
            f"lora.sync=adapter keeps max_staleness + 1 adapter versions and loads the next before unloading: "
            f"server.max_loras={sv.max_loras} must be >= staleness.max_staleness + 2 = {needed}"
        )


def check_lora_rank_choice(config: Config) -> None:
    """server.max_lora_rank is one of the ranks vLLM accepts for --max-lora-rank."""
    rank = config.server.max_lora_rank
    if rank is not None and rank not in VLLM_LORA_RANKS:
        raise ConfigError(f"server.max_lora_rank={rank} must be one of {VLLM_LORA_RANKS}")


def check_ipc_ranks(config: Config) -> None:
    """Several trainer ranks: no CUDA IPC sync."""
    ranks = world_size(config)
    if ranks > 1 and config.server.weight_transfer == "ipc":
        # vLLM's IPC sender all-gathers the handles over the trainer's process group, where only rank 0 sends
        raise ConfigError(
            f"server.weight_transfer=ipc with {ranks} trainer ranks: CUDA IPC shares one process's "
            "memory with a server on the same GPU; use server.weight_transfer=nccl"
        )


def check_rollout_loop(config: Config) -> None:
    from asyncrl.registry import RegistryError, import_object

    try:
        import_object(config.rollout.loop_cls)
    except RegistryError as exc:
        raise ConfigError(f"rollout.loop_cls: {exc}") from exc


def check_trainer_forward(config: Config) -> None:
    """trainer.attention names a registered backend, trainer.compile_layers is true, false, auto or a backend."""
    import torch

    from asyncrl.packing.attention import ATTENTION
    from asyncrl.registry import RegistryError
    from asyncrl.trainer.forward import resolve_compile

    try:
        ATTENTION.get(config.trainer.attention)
    except RegistryError as exc:
        raise ConfigError(f"trainer.attention: {exc}") from exc
    try:
        resolve_compile(config.trainer.compile_layers, torch.device("cpu"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def check_mixed_precision_device(config: Config) -> None:
    import torch

    if config.trainer.fp16 and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.fp16=true: float16 mixed precision with loss scaling runs on a CUDA GPU, and this machine has "
            "none (the CPU trains in float32): drop trainer.fp16"
        )


def check_lr_scheduler(config: Config) -> None:
    """The schedule built once with trainer.lr_scheduler_kwargs on a throwaway optimizer, so that a misspelt or
    missing argument (cosine_with_min_lr needs min_lr or min_lr_rate) fails here, not after the model loaded. The
    constant schedules take none (config/validate.py), and need no transformers import to say so."""
    import torch

    from asyncrl.trainer.model import build_scheduler

    t = config.trainer
    if t.lr_scheduler_type in (LrSchedulerType.constant, LrSchedulerType.constant_with_warmup):
        return
    try:
        build_scheduler(config, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.learning_rate))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"trainer.lr_scheduler_kwargs={dict(t.lr_scheduler_kwargs)} for trainer.lr_scheduler_type="
                          f"{t.lr_scheduler_type}: {str(exc).splitlines()[0]}") from exc  # fmt: skip


def check_gradient_checkpointing_kwargs(config: Config) -> None:
    """The keys must be torch.utils.checkpoint.checkpoint's own: it hands any other to the layer's forward."""
    import inspect

    from torch.utils.checkpoint import checkpoint

    parameters = inspect.signature(checkpoint).parameters.values()
    allowed = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY] + ["preserve_rng_state"]
    unknown = [key for key in config.trainer.gradient_checkpointing_kwargs if key not in allowed]
    if unknown:
        raise ConfigError(f"trainer.gradient_checkpointing_kwargs.{unknown[0]}: torch.utils.checkpoint.checkpoint "
                          f"takes no such argument (it takes {', '.join(allowed)})")  # fmt: skip


def check_callbacks(config: Config) -> None:
    """Each trainer.callbacks entry imports as a class with a hook; the trainer instantiates them as it starts."""
    from asyncrl.trainer.callbacks import resolve_callback

    for path in config.trainer.callbacks:
        resolve_callback(path)


def check_optimizer_factories(config: Config) -> None:
    """trainer.optimizer_factory and scheduler_factory import as functions of the two arguments the trainer passes,
    before a model loads (what they return is checked when the trainer calls them)."""
    from asyncrl.trainer.model import FACTORY_CALLS, resolve_factory

    for key in FACTORY_CALLS:
        if getattr(config.trainer, key) is not None:
            resolve_factory(config, key)


def check_agent_config(config: Config) -> None:
    """Tools and environments import, and the tool-call format is one the parser knows."""
    from asyncrl.registry import RegistryError
    from asyncrl.rollout.environments import load_factories, load_tools
    from asyncrl.rollout.tools import FORMATS

    r = config.rollout
    if r.tool_call_format != "auto" and r.tool_call_format not in FORMATS:
        raise ConfigError(f"rollout.tool_call_format={r.tool_call_format!r}: expected auto or one of {FORMATS}")
    if config.sampling.max_tool_calling_iterations is not None and config.sampling.max_tool_calling_iterations < 0:
        raise ConfigError(
            f"sampling.max_tool_calling_iterations={config.sampling.max_tool_calling_iterations} "
            "must be >= 0 (null = no cap)"
        )
    try:
        load_tools(list(r.tools))
    except (RegistryError, TypeError, ValueError) as exc:
        raise ConfigError(f"rollout.tools: {exc}") from exc
    try:
        factories = load_factories(r.environment_factory)
    except (RegistryError, TypeError) as exc:
        raise ConfigError(f"rollout.environment_factory: {exc}") from exc
    for name, factory in factories.items():
        if not callable(getattr(factory, "reset", None)) and isinstance(factory, type):
            raise ConfigError(
                f"rollout.environment_factory{'' if name is None else f'.{name}'}={factory!r} has no reset method"
            )


def check_vllm_context_without_data(config: Config, backend: str) -> None:
    """No dataset: vLLM's context cannot be sized from the longest prompt."""
    unsized = config.server.max_model_len is None and config.data.max_prompt_length is None
    if config.data.path is None and unsized and backend == "vllm":
        raise ConfigError(
            "data.path is not set, so vLLM's context cannot be sized from the longest prompt: set "
            "server.max_model_len (or data.max_prompt_length)"
        )


def check_quantization(config: Config, backend: str) -> None:
    """server.quantization is vLLM's online quantization of 16-bit weights: the built-in server serves weights as
    they are, and vLLM refuses float32 activations for it (0.33: config/vllm.py, ``get_supported_act_dtypes``)."""
    quantization, dtype = config.server.quantization, config.server.dtype
    if quantization is None:
        return
    if backend == "builtin":
        raise ConfigError(
            f"server.quantization={quantization} is vLLM's: the built-in server cannot quantize; set server=vllm, or "
            "drop server.quantization"
        )
    if dtype == ModelDtype.float32:
        raise ConfigError(
            f"server.quantization={quantization} needs 16-bit serving (vLLM's quantized layers refuse "
            "server.dtype=float32): leave server.dtype unset (bfloat16) or set server.dtype=bfloat16"
        )


def check_generation_kwargs_fields(config: Config, backend: str) -> None:
    """Each sampling.generation_kwargs key is a field the chosen server reads, with a value it applies: both servers
    ignore an unknown field, so a misspelt one would change nothing, silently. vLLM's are its documented sampling
    parameters (VLLM_SAMPLING_FIELDS); the built-in server answers for its own (engine/protocol.py)."""
    from asyncrl.sampling import REQUEST_FIELD_KEYS, REWEIGHTING_FIELDS, VLLM_SAMPLING_FIELDS

    kwargs = config.sampling.generation_kwargs
    if backend == "builtin" and kwargs:
        from asyncrl.engine.protocol import check_request_field  # imports transformers: only for such a run

        for key, value in kwargs.items():
            try:
                check_request_field(key, value)
            except ValueError as exc:
                raise ConfigError(f"sampling.generation_kwargs.{key}: {exc}") from exc
    unknown = sorted(kwargs.keys() - VLLM_SAMPLING_FIELDS)
    if backend == "vllm" and unknown:
        usable = sorted(VLLM_SAMPLING_FIELDS - REQUEST_FIELD_KEYS.keys() - REWEIGHTING_FIELDS)
        raise ConfigError(
            f"sampling.generation_kwargs.{unknown[0]}: not one of vLLM's sampling parameters that asyncrl passes on "
            f"(those: {', '.join(usable)})"
        )


def check_structured_outputs(config: Config, backend: str) -> None:
    """Structured outputs are vLLM's guided decoding, which the built-in server's sampler does not implement."""
    if config.sampling.structured_outputs_regex is not None and backend == "builtin":
        raise ConfigError(
            "sampling.structured_outputs_regex is vLLM's guided decoding: the built-in server cannot hold its sampling "
            "to a regular expression; set server=vllm, or drop sampling.structured_outputs_regex"
        )


def check_builtin_model_impl(config: Config, backend: str) -> None:
    """The built-in server runs transformers' modeling code, what model_impl=transformers asks of vLLM, never vLLM's."""
    if config.server.model_impl == ModelImpl.vllm and backend == "builtin":
        raise ConfigError(
            "server.model_impl=vllm asks for vLLM's implementation of the model, and the built-in server runs "
            "transformers' (it takes auto or transformers): set server=vllm, or server.model_impl=auto"
        )


def check_loss_requirements(config: Config, components: Components) -> None:
    if "sampler_top_logprobs" in components.loss.requires and config.sampling.num_sampler_logprobs < 1:
        raise ConfigError(
            f"loss={config.loss['name']} needs the sampler's top log-probabilities: "
            "set sampling.num_sampler_logprobs >= 1 (default 8) or choose loss=clipped"
        )


def check_loss_options(config: Config, components: Components) -> None:
    """Run the configured loss once on a tiny batch: an unsupported combination fails here, not mid-run."""
    from asyncrl.losses.step import check_loss

    try:
        check_loss(components.loss, config.sampling.num_sampler_logprobs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"loss={config.loss['name']}: {exc}") from exc


def check_reference_model(config: Config, components: Components) -> None:
    """Under LoRA the KL penalty's reference is the base model with the adapters off (trainer/reference.py): there
    is no copy of it to mix the policy into."""
    if components.loss.options.sync_ref_model and config.lora.enabled:
        raise ConfigError(
            "loss.sync_ref_model=true mixes the policy into a copy of the reference, which a LoRA run does not keep "
            "(its reference is the base with the adapters off): set loss.sync_ref_model=false, or lora.enabled=false"
        )


def check_reward_models(config: Config, components: Components) -> None:
    """Each reward model in reward_funcs is a sequence classifier with one label, read from its config.json before
    anything loads (rewards/classifier.py)."""
    from asyncrl.rewards.classifier import check_checkpoint
    from asyncrl.rewards.reward_model import RewardModel

    for index, source in enumerate(components.rewards):
        if isinstance(source.fn, RewardModel):
            check_checkpoint(source.fn.options, f"reward_funcs[{index}]")


FLOW_CHECKS: tuple[Callable[[Config, FlowControl], None], ...] = (
    check_synchronous_sync,
    check_samples_per_step_mode,
    check_adapter_slots,
)
BACKEND_CHECKS: tuple[Callable[[Config, str], None], ...] = (
    check_vllm_context_without_data,
    check_quantization,
    check_generation_kwargs_fields,
    check_structured_outputs,
    check_builtin_model_impl,
)
CHECKS: tuple[Callable[[Config], None], ...] = (
    check_lora_rank_choice,
    check_ipc_ranks,
    check_rollout_loop,
    check_trainer_forward,
    check_mixed_precision_device,
    check_lr_scheduler,
    check_gradient_checkpointing_kwargs,
    check_callbacks,
    check_optimizer_factories,
    check_agent_config,
)
COMPONENT_CHECKS: tuple[Callable[[Config, Components], None], ...] = (
    check_loss_requirements,
    check_loss_options,
    check_reference_model,
    check_reward_models,
)


def build_plan(config: Config, private_weights_dir: Path | None = None, *, job: bool = False) -> RunPlan:
    """Run every check above on a config that passed its own (``to_config``), and decide what the run reads:
    its components (built here once), its flow rules, its rank count, its server backend and serving dtype, and
    whether its syncs are merged before any server answers. ``job``: a training or serving job's plan, which
    fetches what its serving dtype reads (``fetch_checkpoint_config``)."""
    flow = FlowControl.from_config(config)
    for flow_check in FLOW_CHECKS:
        flow_check(config, flow)
    for check in CHECKS:
        check(config)
    backend = resolve_backend(config)
    for backend_check in BACKEND_CHECKS:
        backend_check(config, backend)
    if job:
        fetch_checkpoint_config(config, backend)
    plan = RunPlan(
        config,
        flow,
        ranks_per_node(config),
        world_size(config),
        backend,
        serving_dtype(config, backend),
        runtime_lora(config),
        adapter_sync_by_config(config, backend),
        private_weights_dir,
        weight_transfer=weight_transfer(config, backend, None),
    )
    for component_check in COMPONENT_CHECKS:
        component_check(config, plan.components)
    return plan


def fetch_checkpoint_config(config: Config, backend: str) -> None:
    """The checkpoint's config.json into the Hub cache, for a job whose serving dtype reads it (server.dtype unset, a
    GPU server) when only the Hub has it: the job downloads the checkpoint anyway (a launched vLLM's command fetches
    this file first). Fetched before the plan, the dtype this job freezes (and its processes read in plan.json) is the
    checkpoint's. A Hub that does not answer (asked once: hub.py) or a failed fetch leaves the dtype to what is here
    (the loads report the Hub)."""
    from asyncrl.hub import is_hub_id, unreachable
    from asyncrl.model_kind import local_config_json

    m = config.model
    if config.server.dtype is not None or not is_hub_id(m.name_or_path):
        return
    if local_config_json(m.name_or_path, m.revision) is not None or not serves_on_gpu(config, backend):
        return
    if unreachable() is not None:
        return
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(m.name_or_path, "config.json", revision=m.revision)
    except Exception as error:  # noqa: BLE001 - offline, gated, missing: the model's own load says which
        log.debug("config.json of %s not fetched: %s", m.name_or_path, error)


TRANSFER_PREFIX = "asyncrl-transfer-"
"""The private weights directories' names: the prefix, the launcher's pid, a random part."""


def job_dirs(config: Config, run_dir: Path) -> Path | None:
    """A job's directories, decided before its plan is frozen: trainer.output_dir, else the run directory; and for
    the servers it launches without server.weights_dir, a private weights directory (in /dev/shm when writable,
    else under the run directory), which it returns for the launcher to create and remove."""
    if config.trainer.output_dir is None:
        config.trainer.output_dir = str(run_dir)
    if not config.server.launch or config.server.weights_dir is not None:
        return None
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else run_dir
    private = base / f"{TRANSFER_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    config.server.weights_dir = str(private)
    return private


def placed(plan: RunPlan, gpus: list[str]) -> RunPlan:
    """The plan with a launched vLLM's GPUs and the trainer's split from ``gpus`` (a job's: those visible to its
    launcher), and the weight transfer that split allows; as it was for any other server."""
    config = plan.config
    if plan.server_backend != "vllm" or not config.server.launch:
        return plan
    split = split_gpus(config, gpus)
    return replace(plan, gpu_split=split, weight_transfer=weight_transfer(config, plan.server_backend, split))


def placed_for_printing(plan: RunPlan) -> tuple[RunPlan, str | None]:
    """`asyncrl config --server-command`'s plan: placed on the GPUs visible here, or, on a machine with fewer than the
    run needs (a login node preparing a cluster job), on as many as it needs, with a warning saying so."""
    visible, needed = visible_gpus(), needed_gpus(plan.config)
    if plan.server_backend != "vllm" or not plan.config.server.launch or len(visible) >= needed:
        return placed(plan, visible), None
    gpus = [str(index) for index in range(needed)]
    why = f"{len(visible)} GPU(s) visible here, {needed} needed: the command is for a machine whose "
    return placed(plan, gpus), why + f"CUDA_VISIBLE_DEVICES={','.join(gpus)}"


DEFAULT_PROMPT_TOKENS = 512
"""The prompt length a printed vLLM command assumes when data.max_prompt_length is unset and the prompts cannot be
read here (TRL's max_prompt_length default)."""


def sized(plan: RunPlan, prompt_tokens: int | None = None) -> RunPlan:
    """The plan with its server's context decided (plan/decide.py::max_model_len): the training prompts are measured
    here, once, when vLLM's context takes them or an attached server is to be checked against them, so that the
    launched server's command, the trainer's warm-up, the server checks and a restart read one figure.
    ``prompt_tokens``: the longest prompt, given instead."""
    measured: list[int] = []

    def longest_prompt() -> int:
        from asyncrl.prompts import longest_prompt_tokens
        from asyncrl.rollout.images import image_prompt_tokens

        if not measured:
            given = prompt_tokens is not None
            measured.append(prompt_tokens if given else longest_prompt_tokens(plan.config, image_prompt_tokens))
        return measured[0]

    sv = plan.config.server
    context = max_model_len(plan.config, plan.server_backend, longest_prompt)
    if not sv.launch and sv.max_model_len is None and sv.backend != ServerBackend.builtin:
        longest_prompt()  # an attached server may be a vLLM whatever this machine would launch
    readable = prompt_tokens is None  # a printed command's data that cannot be read here gives its length instead
    images = prompt_images(plan.config) if plan.server_backend == "vllm" and sv.launch and readable else 0
    return replace(plan, max_model_len=context, prompt_tokens=measured[0] if measured else None,
                   prompt_images=images)  # fmt: skip


def prompt_images(config: Config) -> int:
    """The most images a training prompt (of a streamed split: of its first rows) or held-out prompt has."""
    from asyncrl.data import PromptStream, load_eval_prompts, load_train_prompts, most_images

    if config.data.path is None:
        return 0
    train = load_train_prompts(config)
    splits = [train.head if isinstance(train, PromptStream) else train, load_eval_prompts(config)]
    return max(most_images(split) for split in splits if split is not None)


def sized_for_printing(plan: RunPlan) -> tuple[RunPlan, str | None]:
    """`asyncrl config --server-command`'s plan, sized (``sized``) on the prompts here, or, where the data or the
    tokenizer cannot be read (a login node preparing a cluster job), on DEFAULT_PROMPT_TOKENS, with a warning."""
    from asyncrl.data import DatasetError
    from asyncrl.hub_sources import unreachable_for
    from asyncrl.serving.choice import first_line

    if plan.server_backend != "vllm":
        return sized(plan), None
    unreachable_for(plan.config)  # first: a tokenizer that is not cached then fails at once, not after the retries
    try:
        return sized(plan), None
    except (DatasetError, ConfigError, OSError) as error:
        why = (
            f"--max-model-len assumes prompts of up to {DEFAULT_PROMPT_TOKENS} tokens, a default (set "
            f"data.max_prompt_length=N to choose): the prompts cannot be measured here ({first_line(error)})"
        )
        return sized(plan, DEFAULT_PROMPT_TOKENS), why


def commanded(plan: RunPlan) -> RunPlan:
    """The plan with its launched servers' commands decided (``launch_commands``) before any starts, so that
    plan.json holds what runs and a restart launches the same. A vLLM that waits for the trainer's warm-up
    (plan/decide.py::measured_split_pending) gets its commands in the measured stage (``measured``)."""
    if not plan.config.server.launch:
        return plan
    if measured_split_pending(plan):
        return plan
    return replace(plan, server_commands=launch_commands(plan))


def measured(plan: RunPlan, memory: TrainerMemory | None) -> RunPlan:
    """The plan's measured stage: ``memory``, the trainer's footprint its warm-up measured (None where none was:
    trainer.warm_up=false, or `asyncrl serve`, which has no trainer), and the commands of the servers that waited for
    it, a vLLM's share of the GPU it shares with the trainer taken from it (serving/vllm.py::shared_gpu_share)."""
    staged = replace(plan, trainer_memory=memory)
    return replace(staged, server_commands=launch_commands(staged))


def launch_commands(plan: RunPlan) -> list[ServerCommand]:
    """The command of each launched server, replica after replica (serving/choice.py::server_command)."""
    return [server_command(plan, replica) for replica in range(plan.config.server.replicas)]


def plan_run(cfg: DictConfig, run_dir: Path | None = None, *, fetch: bool = False) -> RunPlan:
    """A composed config (``asyncrl.config.compose.compose``), typed, checked and planned; with ``run_dir``, a
    job's plan, its directories decided (``job_dirs``), its checkpoint's config.json here
    (``fetch_checkpoint_config``), its servers placed on the GPUs visible here (``placed``), its server's
    context decided (``sized``) and its launched servers' commands (``commanded``). ``fetch``: that file here too
    without a job (`asyncrl config --server-command` prints the commands of the job the config starts, whose serving
    dtype reads it)."""
    config = to_config(cfg)
    if run_dir is None:
        return build_plan(config, job=fetch)
    return commanded(sized(placed(build_plan(config, job_dirs(config, run_dir), job=True), visible_gpus())))
