"""Cross-field checks on the config's own fields, all run before any process starts.

Each ``check_*`` looks at one rule and raises ``ConfigError`` naming the key, its value and the override
that fixes it. ``validate`` runs them all when a config is composed (config/compose.py). The checks that need
more than the fields (the built components, the servers' and trainer's backends, the flow rules, tools and
environments) run where the run is planned, above all of those (asyncrl/plan/assemble.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from asyncrl.config.errors import ConfigError
from asyncrl.config.optim_args import optimizer_kwargs
from asyncrl.config.schema import Config, LoraSync, LrSchedulerType, OptimizerName
from asyncrl.sampling import REQUEST_FIELD_KEYS, REWEIGHTING_FIELDS


def check_sampling_ranges(config: Config) -> None:
    s = config.sampling
    if s.num_generations < 2:
        raise ConfigError(
            f"sampling.num_generations={s.num_generations}: a group needs at least 2 rollouts to have an "
            "advantage baseline (try sampling.num_generations=8)"
        )
    if s.max_completion_length < 1:
        raise ConfigError(f"sampling.max_completion_length={s.max_completion_length} must be >= 1")
    if s.temperature <= 0:
        raise ConfigError(f"sampling.temperature={s.temperature} must be > 0 (RL needs a stochastic sampler)")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"sampling.top_p={s.top_p} must be in (0, 1]")
    if not 0 <= s.min_p < 1:
        raise ConfigError(f"sampling.min_p={s.min_p} must be in [0, 1)")
    if s.top_k < 0:
        raise ConfigError(f"sampling.top_k={s.top_k} must be >= 0 (0 = off)")
    if s.num_sampler_logprobs < 0:
        raise ConfigError(f"sampling.num_sampler_logprobs={s.num_sampler_logprobs} must be >= 0")
    if s.num_generations_eval < 1:
        raise ConfigError(f"sampling.num_generations_eval={s.num_generations_eval} must be >= 1 (1 = one per prompt)")


def check_truncation_needs_top_k(config: Config) -> None:
    s = config.sampling
    if s.top_p < 1.0 and s.top_k <= 0:
        raise ConfigError(
            f"sampling.top_p={s.top_p} needs sampling.top_k > 0: top_k bounds the candidate set the trainer "
            "renormalises over (try sampling.top_k=512)"
        )
    if s.min_p > 0 and s.top_k <= 0:
        raise ConfigError(f"sampling.min_p={s.min_p} needs sampling.top_k > 0 (try sampling.top_k=512)")


def check_sampler_matches_trainer(config: Config) -> None:
    """Refuse a sampler that moves single tokens' probabilities by a rule the trainer's log-probs do not apply.

    Every loss compares the trainer's probability of each token with the sampler's, its behaviour policy (the
    importance ratio; loss.importance_sampling=none only stops masking or truncating it). A repetition, presence or
    frequency penalty, or a logit bias, would then train as off-policy drift on exactly the tokens it moved, their
    ratios unbounded above. TRL refuses repetition_penalty only with its importance-sampling correction on, because
    without it TRL recomputes the old log-probs on the trainer; asyncrl's behaviour policy is always the sampler.
    Modelling a penalty instead would take each position's set of tokens seen so far into the packed forward (a
    vocabulary-wide mask per position). Masks are not refused (structured outputs, bad_words, allowed_token_ids):
    renormalising over the allowed tokens scales every ratio at a position by one factor of at most 1."""
    s = config.sampling
    if s.repetition_penalty != 1.0:
        raise ConfigError(
            f"sampling.repetition_penalty={s.repetition_penalty}: the trainer's log-probs do not apply the penalty, so "
            "every loss's importance ratio against the sampler (whatever loss.importance_sampling says, none included) "
            "would train it as off-policy drift: set sampling.repetition_penalty=1.0"
        )
    reweighting = sorted(REWEIGHTING_FIELDS & s.generation_kwargs.keys())
    if reweighting:
        raise ConfigError(
            f"sampling.generation_kwargs.{reweighting[0]} moves single tokens' probabilities, which the trainer's "
            "log-probs do not apply (every loss's importance ratio would train it as off-policy drift): remove it"
        )


def check_generation_kwargs(config: Config) -> None:
    """generation_kwargs adds fields to each request and replaces none that asyncrl sets: the trainer computes its
    log-probs, and reads each response, from those values (TRL lets a conflicting key win instead)."""
    owned = [key for key in config.sampling.generation_kwargs if key in REQUEST_FIELD_KEYS]
    if owned:
        key, source = owned[0], REQUEST_FIELD_KEYS[owned[0]]
        how = f"on every request from {source}: set that instead" if source else "itself, on every request: remove it"
        raise ConfigError(f"sampling.generation_kwargs.{key}: asyncrl sets {key} {how}")


def check_staleness(config: Config) -> None:
    st = config.staleness
    if st.max_staleness < 0:
        raise ConfigError(f"staleness.max_staleness={st.max_staleness} must be >= 0 (0 = synchronous GRPO)")
    if st.weight_sync_steps < 1:
        raise ConfigError(f"staleness.weight_sync_steps={st.weight_sync_steps} must be >= 1")
    if st.max_concurrent_rollouts < 1:
        raise ConfigError(f"staleness.max_concurrent_rollouts={st.max_concurrent_rollouts} must be >= 1")
    if st.rollout_worker_timeout <= 0:
        raise ConfigError(f"staleness.rollout_worker_timeout={st.rollout_worker_timeout} must be > 0 seconds")


def check_trainer_rates(config: Config) -> None:
    t = config.trainer
    for key in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon", "max_restarts"):
        value = getattr(t, key)
        if value < 0:
            raise ConfigError(f"trainer.{key}={value} must be >= 0")
    if t.gradient_accumulation_steps < 1:
        raise ConfigError(f"trainer.gradient_accumulation_steps={t.gradient_accumulation_steps} must be >= 1")
    if t.num_iterations < 1:
        raise ConfigError(f"trainer.num_iterations={t.num_iterations} must be >= 1 (1 = one optimizer pass per step)")
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        raise ConfigError(
            f"trainer.max_steps={t.max_steps} and trainer.num_train_epochs={t.num_train_epochs}: "
            "set one of them > 0 so training can stop"
        )
    if t.logging_steps < 1:
        raise ConfigError(f"trainer.logging_steps={t.logging_steps} must be >= 1")
    if t.cpu_threads is not None and t.cpu_threads < 1:
        raise ConfigError(f"trainer.cpu_threads={t.cpu_threads} must be >= 1 (or null: the cores the server leaves)")
    if config.server.cpu_threads < 1:
        raise ConfigError(f"server.cpu_threads={config.server.cpu_threads} must be >= 1")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        raise ConfigError(f"trainer.peak_tflops={t.peak_tflops} must be > 0 (or null: the GPU's datasheet figure)")
    if any(step < 1 for step in config.logging.profile_steps):
        raise ConfigError(f"logging.profile_steps={list(config.logging.profile_steps)}: steps count from 1")
    if t.save_strategy not in ("steps", "no"):
        raise ConfigError(f"trainer.save_strategy={t.save_strategy!r} must be 'steps' or 'no'")
    if t.save_strategy == "steps" and t.save_steps < 1:
        raise ConfigError(f"trainer.save_steps={t.save_steps} must be >= 1 (or trainer.save_strategy=no)")
    if t.save_total_limit is not None and t.save_total_limit < 1:
        raise ConfigError(
            f"trainer.save_total_limit={t.save_total_limit} would delete every checkpoint, the last "
            "one included: set it >= 1, or null to keep them all"
        )
    if t.lr_scheduler_type != "constant" and t.max_steps <= 0:
        raise ConfigError(
            f"trainer.lr_scheduler_type={t.lr_scheduler_type} decays over optimizer steps, which an epoch-based "
            "run cannot know in advance: set trainer.max_steps too"
        )


def check_optimizer_factories(config: Config) -> None:
    """trainer.optimizer_factory and scheduler_factory build what other keys would: those keys are refused beside
    them rather than ignored, and the schedule's factory is given trainer.max_steps, which an epoch-based run cannot
    know in advance. The functions themselves are checked where the trainer calls them (trainer/model.py)."""
    t = config.trainer
    replaced = (
        ("optimizer_factory", "optim", t.optim != OptimizerName.adamw_torch),
        ("optimizer_factory", "optim_args", bool(t.optim_args)),
        ("scheduler_factory", "lr_scheduler_type", t.lr_scheduler_type != LrSchedulerType.constant),
        ("scheduler_factory", "lr_scheduler_kwargs", bool(t.lr_scheduler_kwargs)),
        ("scheduler_factory", "warmup_steps", t.warmup_steps != 0),
    )
    for factory, key, is_set in replaced:
        value = getattr(t, key)
        if is_set and getattr(t, factory) is not None:
            shown = repr(value) if type(value) is str else value  # optim_args quoted, as Hydra takes it
            raise ConfigError(f"trainer.{key}={shown} does nothing beside trainer.{factory}={getattr(t, factory)}, "
                              f"whose function replaces it: drop trainer.{key}")  # fmt: skip
    if t.scheduler_factory is not None and t.max_steps <= 0:
        raise ConfigError(f"trainer.scheduler_factory={t.scheduler_factory} is given the run's optimizer steps, which "
                          "an epoch-based run cannot know in advance: set trainer.max_steps too")  # fmt: skip


def check_optim_args(config: Config) -> None:
    """trainer.optim_args reads into keywords that trainer.optim's optimizer takes (config/optim_args.py)."""
    optimizer_kwargs(config.trainer)


def check_save_only_model(config: Config) -> None:
    """An automatic restart resumes from the newest checkpoint, which a model-only one cannot."""
    t = config.trainer
    if t.save_only_model and t.max_restarts > 0:
        raise ConfigError(
            f"trainer.save_only_model=true with trainer.max_restarts={t.max_restarts}: a restart resumes from a "
            "checkpoint, which one holding the model only cannot; keep one (trainer.max_restarts=0)"
        )


def check_mixed_precision(config: Config) -> None:
    t = config.trainer
    if t.fp16 and t.bf16:
        raise ConfigError(
            "trainer.fp16=true and trainer.bf16=true ask for two mixed precisions: keep one (fp16 for a GPU without "
            "bfloat16, else trainer.fp16=false)"
        )


def check_ignored_kwargs(config: Config) -> None:
    """Keyword arguments that nothing would receive are refused rather than dropped: transformers' get_scheduler
    passes none to the constant schedules."""
    t = config.trainer
    if t.gradient_checkpointing_kwargs and not t.gradient_checkpointing:
        raise ConfigError(
            f"trainer.gradient_checkpointing_kwargs={dict(t.gradient_checkpointing_kwargs)} with "
            "trainer.gradient_checkpointing=false: set trainer.gradient_checkpointing=true, or drop the kwargs"
        )
    constant = t.lr_scheduler_type in (LrSchedulerType.constant, LrSchedulerType.constant_with_warmup)
    if t.lr_scheduler_kwargs and constant:
        raise ConfigError(
            f"trainer.lr_scheduler_kwargs={dict(t.lr_scheduler_kwargs)}: trainer.lr_scheduler_type="
            f"{t.lr_scheduler_type} takes none; drop them, or choose a schedule that does (e.g. cosine_with_min_lr)"
        )


def check_samples_per_step(config: Config) -> None:
    """A fixed number of samples per step replaces the micro-batch count, and needs a step to end mid-batch."""
    t = config.trainer
    if t.samples_per_step is None:
        return
    if t.samples_per_step < 1:
        raise ConfigError(f"trainer.samples_per_step={t.samples_per_step} must be >= 1 (or null: token-budget steps)")
    if t.gradient_accumulation_steps != 1:
        raise ConfigError(
            f"trainer.samples_per_step={t.samples_per_step} sets the step's size and its rows: drop "
            f"trainer.gradient_accumulation_steps={t.gradient_accumulation_steps}, or set trainer.samples_per_step=null"
        )


def check_eval_steps(config: Config) -> None:
    """An evaluation inside the run sees the weights of its step only at a weight sync."""
    lg, t, every = config.logging, config.trainer, config.staleness.weight_sync_steps
    if lg.eval_steps is not None and (lg.eval_steps < 0 or lg.eval_steps % every):
        raise ConfigError(
            f"logging.eval_steps={lg.eval_steps} must be a multiple of staleness.weight_sync_steps={every} (the "
            "server holds a step's weights only after its sync), or 0/null: evaluate only before and after"
        )
    if lg.eval_on_save and t.save_strategy == "steps" and t.save_steps % every:
        raise ConfigError(
            f"logging.eval_on_save=true evaluates at trainer.save_steps={t.save_steps}, which must be a multiple of "
            f"staleness.weight_sync_steps={every} (the server holds a step's weights only after its sync)"
        )


def check_server_config(config: Config) -> None:
    sv = config.server
    if not sv.launch and not sv.base_url and sv.base_urls is None:
        raise ConfigError("server.launch=false attaches to a running server: set server.base_url=http://HOST:PORT")
    if not 0 < sv.port < 65536:
        raise ConfigError(f"server.port={sv.port} is not a TCP port")
    if sv.timeout <= 0:
        raise ConfigError(f"server.timeout={sv.timeout} must be > 0 seconds")
    if sv.health_timeout is not None and sv.health_timeout <= 0:
        raise ConfigError(f"server.health_timeout={sv.health_timeout} must be > 0 seconds (null: no watchdog)")
    if sv.max_num_seqs < 1:
        raise ConfigError(f"server.max_num_seqs={sv.max_num_seqs} must be >= 1")
    if sv.max_model_len is not None and sv.max_model_len <= config.sampling.max_completion_length:
        raise ConfigError(
            f"server.max_model_len={sv.max_model_len} leaves no room for a prompt with "
            f"sampling.max_completion_length={config.sampling.max_completion_length}"
        )
    if config.sampling.num_sampler_logprobs > sv.max_logprobs:
        raise ConfigError(
            f"sampling.num_sampler_logprobs={config.sampling.num_sampler_logprobs} exceeds "
            f"server.max_logprobs={sv.max_logprobs} (the server's --max-logprobs): raise server.max_logprobs"
        )


def check_lora(config: Config) -> None:
    lora, sv = config.lora, config.server
    if not lora.enabled:
        return
    if lora.r < 1:
        raise ConfigError(f"lora.r={lora.r} must be >= 1")
    targets = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    if "lm_head" in targets or "lm_head" in (lora.modules_to_save or []):
        raise ConfigError("lora.target_modules must not include lm_head: adapters on lm_head are not supported")
    if sv.max_lora_rank is not None and lora.r > sv.max_lora_rank:
        raise ConfigError(f"lora.r={lora.r} exceeds server.max_lora_rank={sv.max_lora_rank}")
    if not config.model.freeze_vision_tower:
        raise ConfigError(
            "model.freeze_vision_tower=false with lora.enabled=true: LoRA adapts the text model only and keeps the "
            "vision tower frozen; drop one of them (model.freeze_vision_tower=true, or lora.enabled=false)"
        )
    if config.model.disable_dropout and lora.dropout > 0:
        raise ConfigError(
            f"lora.dropout={lora.dropout} with model.disable_dropout=true: the adapters' dropout would be asked for "
            "and disabled at once; set lora.dropout=0 or model.disable_dropout=false"
        )


def check_vllm_server(config: Config) -> None:
    sv = config.server
    for key in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(sv, key) < 1:
            raise ConfigError(f"server.{key}={getattr(sv, key)} must be >= 1")
    if sv.gpu_memory_utilization is not None and not 0 < sv.gpu_memory_utilization <= 1:
        raise ConfigError(f"server.gpu_memory_utilization={sv.gpu_memory_utilization} must be in (0, 1]")
    engines = sv.tensor_parallel_size * sv.data_parallel_size
    if sv.gpus is not None and sv.gpus < engines:
        raise ConfigError(
            f"server.gpus={sv.gpus} is fewer than server.tensor_parallel_size x server.data_parallel_size = {engines}"
        )
    if config.trainer.gpus is not None and config.trainer.gpus < 1:
        raise ConfigError(f"trainer.gpus={config.trainer.gpus} must be >= 1")
    if config.trainer.num_processes is not None and config.trainer.num_processes < 1:
        raise ConfigError(f"trainer.num_processes={config.trainer.num_processes} must be >= 1")
    check_nodes(config)
    if sv.api_server_count is not None and sv.api_server_count < 1:
        raise ConfigError(f"server.api_server_count={sv.api_server_count} must be >= 1")
    adapters = config.lora.enabled and config.lora.sync != LoraSync.merged
    if adapters and (sv.api_server_count or 1) > 1:
        raise ConfigError(
            f"server.api_server_count={sv.api_server_count}: vLLM refuses runtime LoRA loading with more than one "
            "API server; set server.api_server_count=1 or lora.sync=merged"
        )


def check_replicas(config: Config) -> None:
    """Several servers: launched (server.replicas) or attached (server.base_urls), never both, and each gets
    every weight sync, which ipc (one co-located server) and one sharded trainer's rank 0 cannot give."""
    sv = config.server
    if sv.replicas < 1:
        raise ConfigError(f"server.replicas={sv.replicas} must be >= 1")
    if sv.replicas > 1 and not sv.launch:
        raise ConfigError(
            f"server.replicas={sv.replicas} launches servers, but server.launch=false attaches: list the running "
            "ones in server.base_urls=[...] instead"
        )
    if sv.base_urls is not None and sv.base_url:
        raise ConfigError("server.base_url and server.base_urls are both set: keep one (base_urls for several)")
    if sv.base_urls is not None and sv.launch:
        raise ConfigError("server.base_urls attaches to running servers: set server.launch=false too")
    if sv.base_urls is not None and not sv.base_urls:
        raise ConfigError("server.base_urls=[] lists no server: list at least one, or use server.base_url")
    servers = sv.replicas if sv.launch else len(sv.base_urls or [None])
    if servers > 1 and sv.weight_transfer == "ipc":
        raise ConfigError(
            f"server.weight_transfer=ipc with {servers} servers: CUDA IPC reaches one server on the trainer's GPU; "
            "use server.weight_transfer=nccl"
        )


def check_rollout_limits(config: Config) -> None:
    r = config.rollout
    if r.score_queue_maxsize < 1:
        raise ConfigError(f"rollout.score_queue_maxsize={r.score_queue_maxsize} must be >= 1")
    if r.score_concurrency < 1:
        raise ConfigError(f"rollout.score_concurrency={r.score_concurrency} must be >= 1")
    if r.max_consecutive_dropped_groups is not None and r.max_consecutive_dropped_groups < 1:
        raise ConfigError(
            f"rollout.max_consecutive_dropped_groups={r.max_consecutive_dropped_groups} must be >= 1 (null: never stop)"
        )
    if not 0 <= r.max_failed_group_fraction <= 1:
        raise ConfigError(f"rollout.max_failed_group_fraction={r.max_failed_group_fraction} must be in [0, 1]")
    retire = config.data.retire_solved_after
    if retire is not None and retire < 1:
        raise ConfigError(f"data.retire_solved_after={retire} must be >= 1 (null: never retire a prompt)")


def check_reward_funcs(config: Config) -> None:
    if not config.reward_funcs and config.rollout.environment_factory is None:
        raise ConfigError(
            "reward_funcs is empty (and no rollout.environment_factory supplies a reward): choose a preset "
            "(reward=accuracy) or list functions (reward_funcs=[{name: accuracy}, {name: my_pkg.rewards:fn}])"
        )
    weights = config.reward_weights
    if weights is not None and len(weights) != len(config.reward_funcs):
        raise ConfigError(
            f"reward_weights={list(weights)} has {len(weights)} weights for {len(config.reward_funcs)} reward_funcs: "
            "give one per function, in their order (or reward_weights=null: each weighs 1)"
        )
    if weights is not None and not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"reward_weights={list(weights)}: every weight must be a finite number")


def check_completion_tables(config: Config) -> None:
    """logging.log_unique_prompts thins the completions table of the trackers and the Hub: without one it would do
    nothing."""
    lg = config.logging
    if lg.log_unique_prompts and not (lg.log_completions and (lg.report_to or lg.log_completions_hub_repo)):
        raise ConfigError(
            "logging.log_unique_prompts=true thins the completions table, which this run does not log: set "
            "logging.log_completions=true and logging.report_to=[...] or logging.log_completions_hub_repo, or drop it"
        )


def check_completions_hub_repo(config: Config) -> None:
    """logging.log_completions_hub_repo uploads the table logging.log_completions makes: without it, nothing."""
    lg = config.logging
    if lg.log_completions_hub_repo is not None and not lg.log_completions:
        raise ConfigError(
            f"logging.log_completions_hub_repo={lg.log_completions_hub_repo} uploads the completions that "
            "logging.log_completions=true logs: set it, or drop logging.log_completions_hub_repo"
        )


def check_hub(config: Config) -> None:
    """hub.hub_model_id is a repository id by huggingface_hub's own rule, checked before training, not at the first
    push (a null one, the run's name, is checked as the repository is created: hub_push.py)."""
    repo_id = config.hub.hub_model_id
    if not config.hub.push_to_hub or repo_id is None:
        return
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"hub.hub_model_id={repo_id}: {reason} (e.g. hub.hub_model_id=my-org/my-model)") from exc


def check_data_source(config: Config) -> None:
    """No dataset: a single environment supplies every prompt from reset(), and there are no epochs to count."""
    if config.data.num_eval_prompts < 0:
        raise ConfigError(f"data.num_eval_prompts={config.data.num_eval_prompts} must be >= 0 (0 = no evaluation)")
    if config.data.path is not None:
        return
    factory = config.rollout.environment_factory
    if factory is None or hasattr(factory, "items"):
        raise ConfigError(
            "data.path is not set: without a dataset only a single rollout.environment_factory (whose reset() "
            "returns the prompt) can supply prompts; a mapping routes by the dataset's `environment` column. "
            "Set data.path=FILE_OR_HUB_ID"
        )
    if config.trainer.max_steps <= 0:
        raise ConfigError(
            f"data.path is not set, so the environment supplies the prompts and there are no epochs: "
            f"trainer.max_steps={config.trainer.max_steps} must be > 0 (try trainer.max_steps=100)"
        )


def check_streaming(config: Config) -> None:
    """A streamed split (data.streaming) has no length to count epochs by, and is never held whole: what needs
    every row at once is refused."""
    d = config.data
    if not d.streaming:
        return
    if d.path is None:
        raise ConfigError("data.streaming=true streams data.path, which is not set: set data.path or drop streaming")
    if config.trainer.max_steps <= 0:
        raise ConfigError(
            f"data.streaming=true: a stream's length is unknown, so trainer.max_steps={config.trainer.max_steps} "
            "cannot leave the epochs to end the run: set trainer.max_steps=N"
        )
    if d.shuffle_buffer_size < 1:
        raise ConfigError(f"data.shuffle_buffer_size={d.shuffle_buffer_size} must be >= 1")
    if d.retire_solved_after is not None:
        raise ConfigError(
            f"data.retire_solved_after={d.retire_solved_after} retires rows by their place in the split, which a "
            "streamed split (data.streaming=true) reshuffles every pass: drop one of the two"
        )
    if hasattr(config.rollout.environment_factory, "items"):
        raise ConfigError(
            "rollout.environment_factory maps names to environments, and every row's routing column is checked "
            "before the run: a streamed split (data.streaming=true) cannot be read whole for that; use a single "
            "environment, or drop data.streaming"
        )


CHECKS: tuple[Callable[[Config], None], ...] = (
    check_sampling_ranges,
    check_truncation_needs_top_k,
    check_sampler_matches_trainer,
    check_generation_kwargs,
    check_staleness,
    check_trainer_rates,
    check_optimizer_factories,
    check_optim_args,
    check_save_only_model,
    check_mixed_precision,
    check_ignored_kwargs,
    check_samples_per_step,
    check_eval_steps,
    check_server_config,
    check_replicas,
    check_lora,
    check_vllm_server,
    check_rollout_limits,
    check_reward_funcs,
    check_data_source,
    check_streaming,
    check_hub,
    check_completion_tables,
    check_completions_hub_repo,
)


def check_nodes(config: Config) -> None:
    """Several nodes meet at a rendezvous that every node reaches: its HOST:PORT cannot be guessed."""
    t = config.trainer
    if t.nnodes < 1:
        raise ConfigError(f"trainer.nnodes={t.nnodes} must be >= 1")
    if t.rdzv_endpoint is None:
        if t.nnodes > 1:
            raise ConfigError(
                f"trainer.nnodes={t.nnodes} needs trainer.rdzv_endpoint=HOST:PORT: this node's address that the "
                "other nodes reach, and a free port (the same as their torchrun --rdzv-endpoint)"
            )
        return
    host, _, port = t.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"trainer.rdzv_endpoint={t.rdzv_endpoint} must be HOST:PORT, e.g. node001:29400")


def validate(config: Config) -> None:
    """Run every check on the config's own fields."""
    for check in CHECKS:
        check(config)
