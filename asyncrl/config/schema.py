"""Typed schema of every settings group; Hydra uses it so a wrong type or unknown key fails at composition.

Settings groups are dataclasses. Component groups (`reward`, `loss`, `advantage`, `packing`) are
``{name, **options}`` mappings, free-form here: the named component's registry builds its typed options
from them (``asyncrl.components.build_components``). Defaults follow the spec (reference/async_grpo.md,
AsyncGRPOConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from omegaconf import MISSING

from asyncrl.sampling import Decoding


class ServerBackend(str, Enum):
    auto = "auto"
    vllm = "vllm"
    builtin = "builtin"


class ModelImpl(str, Enum):
    """vLLM's --model-impl choices for a language model (its terratorch, for geospatial models, left out)."""

    auto = "auto"
    vllm = "vllm"
    transformers = "transformers"


class WeightTransfer(str, Enum):
    auto = "auto"
    nccl = "nccl"
    ipc = "ipc"


class ModelDtype(StrEnum):
    """A StrEnum: formatted as its value wherever a dtype string is expected (command lines, lookups)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LrSchedulerType(StrEnum):
    """transformers' schedulers (get_scheduler) that follow the optimizer steps alone; their own arguments come in
    trainer.lr_scheduler_kwargs (reduce_lr_on_plateau and greedy read a metric each step: not offered)."""

    constant = "constant"
    constant_with_warmup = "constant_with_warmup"
    linear = "linear"
    cosine = "cosine"
    cosine_with_restarts = "cosine_with_restarts"
    polynomial = "polynomial"
    inverse_sqrt = "inverse_sqrt"
    cosine_with_min_lr = "cosine_with_min_lr"
    cosine_warmup_with_min_lr = "cosine_warmup_with_min_lr"
    warmup_stable_decay = "warmup_stable_decay"


class OptimizerName(StrEnum):
    """trainer.optim: transformers' names (OptimizerNames) of torch's optimizers that step FSDP2's sharded (DTensor)
    parameters, which asyncrl trains at every world size (asyncrl/trainer/model.py builds them). Not offered: Adafactor
    (torch's and transformers') and bitsandbytes' 8-bit AdamW (0.50), which fail on them; the names of other packages'
    optimizers (torchao, GaLore, APOLLO, LOMO, schedule-free, ...) and of other devices' kernels (XLA, NPU), which
    trainer.optimizer_factory can build."""

    adamw_torch = "adamw_torch"
    adamw_torch_fused = "adamw_torch_fused"
    sgd = "sgd"
    adagrad = "adagrad"
    rmsprop = "rmsprop"


class LoraSync(str, Enum):
    auto = "auto"
    merged = "merged"
    adapter = "adapter"


class HubStrategy(StrEnum):
    """transformers' hub_strategy: what goes to the Hub besides the final model (asyncrl/hub_push.py)."""

    end = "end"
    every_save = "every_save"
    checkpoint = "checkpoint"
    all_checkpoints = "all_checkpoints"


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    """Hub id or local directory (save_pretrained layout); also the served model name."""
    dtype: ModelDtype = ModelDtype.float32
    """Weights dtype: auto|float32|bfloat16|float16. float32 keeps the trainer-sampler mismatch small."""
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    revision: str | None = None
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for from_pretrained; a dtype here wins over `dtype`."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-Experts load-balancing loss weight (logged as aux_loss): null = the model config's value, 0 =
    off; set on a dense model it is a config error."""
    disable_dropout: bool = False
    """Set every dropout of the policy and the reference to 0 (each torch.nn.Dropout's p and each attention module's
    attention_dropout), as TRL's disable_dropout (off by default there too): the policy trains in train() mode, where
    a checkpoint's dropout makes its log-probs differ from the sampler's and the reference's for the same tokens."""
    cast_lm_head_to_fp32: bool = False
    """The LM head of the policy and the reference in float32, its input cast up, so its logits are float32 matmuls
    over float32 weights where the rest computes in bfloat16 (TRL's cast_lm_head_to_fp32, from ScaleRL): under FSDP2
    the head is a unit of its own, gathered in float32 (trainer/fsdp.py). Refused with tied embeddings, as TRL's."""
    freeze_vision_tower: bool = True
    """A vision-language checkpoint's modules outside its text model (the vision tower, the projector/merger) stay as
    loaded, as the spec trains these checkpoints: no gradients or optimizer state, and weight syncs never send them
    (the server keeps its own). false trains them with the text model (float32 master weights and optimizer state:
    more memory) and every sync sends them, e.g. when the images are unlike the tower's pretraining. Refused with
    LoRA, whose adapters stay out of the tower; nothing to unfreeze on a text-only checkpoint."""


@dataclass
class SamplingConfig(Decoding):
    """The decoding knobs (temperature, top_p, top_k, min_p, repetition_penalty, structured_outputs_regex,
    generation_kwargs: asyncrl/sampling.py) and the run's other sampling settings."""

    num_generations: int = 8
    """Rollouts per prompt (the group size)."""
    num_generations_eval: int = 1
    """Sampled completions per held-out prompt, averaged in eval/sampled_reward (TRL's num_generations_eval); the
    greedy pass draws one."""
    max_completion_length: int = 2048
    """Tokens generated per server request, i.e. per turn."""
    num_sampler_logprobs: int = 8
    """Top log-probabilities requested per generated token (score centering needs them)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tool_calling_iterations: int | None = None


@dataclass
class StalenessConfig:
    max_staleness: int = 4
    """Weight versions a sample may lag before it is dropped; 0 = synchronous, strictly on-policy GRPO."""
    weight_sync_steps: int = 1
    max_concurrent_rollouts: int = 512
    """Ceiling on rollouts in flight (environments, tool threads and server connections)."""
    rollout_worker_timeout: float = 300.0
    """Seconds without worker progress before the trainer aborts, saying what the worker waited on."""
    in_flight_weight_updates: bool = False
    """A weight sync keeps the server's KV cache: requests in flight go on under the new weights where they stopped
    (PipelineRL's in-flight updates) instead of being preempted and prefilled again. Each token keeps the sampler's
    log-probability it was drawn with, so the importance correction holds per token; a sample's staleness is still
    counted from the version its group started under (its oldest). Off: no token is computed on a cache the old
    weights made."""


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Any = "all-linear"
    """'all-linear' or a list of module names; lm_head is refused."""
    bias: str = "none"
    modules_to_save: list[str] | None = None
    sync: LoraSync = LoraSync.auto
    """merged: merge and send full weights; adapter: send only the adapter; auto: adapter if the server can."""


@dataclass
class ServerConfig:
    backend: ServerBackend = ServerBackend.auto
    """auto: vLLM when importable and a GPU is present, else the built-in server."""
    launch: bool = True
    """false: attach to an already running server at base_url."""
    base_url: str | None = None
    """Where the run's clients reach the server; defaults to http://{host}:{port}. With a launched server it may
    differ (a proxy in front of it): the server still listens on host:port."""
    base_urls: list[str] | None = None
    """server.launch=false: attach to several running servers (e.g. on other nodes), e.g. [http://a:8000,
    http://b:8000]; rollouts are spread over them by load and every weight sync reaches them all. base_url is the
    one-server spelling (set one of the two)."""
    replicas: int = 1
    """Servers asyncrl launches, each on its own port (port, port+1, ...) and, for vLLM, its own GPUs (server.gpus
    each). A replica that dies stops the run: one that died mid-sync would serve a stale policy."""
    host: str = "127.0.0.1"
    port: int = 8000
    timeout: float = 1800.0
    """Seconds for server readiness, each generation request and each weight-sync call."""
    health_timeout: float | None = 120.0
    """Seconds a generation server may leave /health unanswered while the trainer waits for rollouts or for a weight
    sync's calls before the run stops as if it had died (restarted with trainer.max_restarts): a hung server still
    accepts connections. A slow answer that comes is fine, and so is a slow sync call while /health answers. null:
    off."""
    max_model_len: int | None = None
    """Built-in default: the model's max_position_embeddings. vLLM default: the same for multi-turn rollouts (tools or
    environments); else the longest prompt (data.max_prompt_length, else measured on the data) +
    sampling.max_completion_length."""
    dtype: ModelDtype | None = None
    """Serving dtype (weight syncs send it). None: 16 bits for a server on a GPU (bfloat16; float16 for a float16
    checkpoint), model.dtype on the CPU."""
    device: str = "auto"
    """Built-in server device: auto|cpu|cuda."""
    max_num_seqs: int = 64
    """Built-in server: rows decoded together in one batch."""
    cpu_threads: int = 1
    """Built-in server on CPU: torch intra-op threads (the trainer keeps the other cores)."""
    gpus: int | None = None
    """vLLM: GPUs for the server, taken first from the visible ones (default tensor x data parallel size); the
    trainer gets the rest, or shares the server's first GPU when none is left."""
    gpu_memory_utilization: float | None = None
    """vLLM's share of each of its GPUs. None: 0.9 on GPUs of its own; on a GPU shared with the trainer, what the
    trainer's footprint measured by its warm-up step leaves, less a margin (asyncrl/trainer/memory.py); the startup
    log says which."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    api_server_count: int | None = None
    """vLLM API processes. Default: 1 with runtime LoRA adapters (vLLM refuses more), 8 on vLLM >= 0.32 (cheap
    top log-probabilities), else vLLM's own default."""
    weight_transfer: WeightTransfer = WeightTransfer.auto
    """vLLM weight sync: nccl (own GPUs), ipc (server and trainer share a GPU); auto picks from the GPU split,
    or from the attached server's --weight-transfer-config."""
    ipc_direct_load: bool = True
    """ipc sync loads weights in place from one buffer shared once, through asyncrl's vLLM worker extension
    (added to the vLLM asyncrl launches; an attached server needs --worker-extension-cls
    asyncrl.weights.vllm_extension.WeightBufferExtension). A quantized server, or one spanning several GPUs, gets
    vLLM's own ipc engine whatever this says (the startup log says why); false: always vLLM's engine."""
    quantization: str | None = None
    """vLLM's --quantization for the vLLM asyncrl launches (an attached one is checked for it), e.g. fp8: vLLM
    quantizes the 16-bit weights as it loads them (online; vLLM 0.33 reads fp8 as fp8_per_tensor). The sampler then
    agrees less with the trainer; the loss's importance-sampling correction covers that as any sampler mismatch
    (sampling/sampling_logp_difference measures it). Weight syncs keep sending 16-bit weights, through vLLM's own
    engine (ipc on a GPU shared with the trainer, nccl on the server's own), whose weight-update session
    re-quantizes every layer as its weights arrive (layerwise reload); asyncrl's in-place ipc loader
    (server.ipc_direct_load) would skip that, so a quantized server never gets it. vLLM only, 16-bit serving only;
    null: the checkpoint's own weights."""
    model_impl: ModelImpl = ModelImpl.auto
    """The model's implementation in vLLM (its --model-impl; TRL's vllm_model_impl): auto (vLLM's own where it has
    one, else transformers'), vllm, or transformers (transformers' modeling code inside vLLM's engine, e.g. for an
    architecture vLLM does not implement). The built-in server runs transformers' code already: it takes auto and
    transformers, and refuses vllm."""
    vllm_version: str | None = None
    """The vLLM release `vllm serve` runs, for its version-dependent flags; default: the installed vllm."""
    max_logprobs: int = 20
    max_loras: int | None = None
    max_lora_rank: int | None = None
    weights_dir: str | None = None
    """The directory weights and LoRA adapters travel through to the server; the built-in server loads from no
    other (its --weights-dir). Default: a fresh one per run (in /dev/shm when writable), removed at its end; with
    server.launch=false, the attached server's (`asyncrl serve` prints it), else the run directory."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to the server command line."""


@dataclass
class TrainerConfig:
    output_dir: str | None = None
    """Defaults to the Hydra run directory."""
    seed: int = 42
    max_steps: int = -1
    """> 0: stop after this many optimizer steps (disables the epoch stop)."""
    num_train_epochs: float = 3.0
    learning_rate: float = 1e-6
    lr_scheduler_type: LrSchedulerType = LrSchedulerType.constant
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """The schedule's own arguments, passed to transformers' get_scheduler (its scheduler_specific_kwargs), e.g.
    {min_lr_rate: 0.1} for cosine_with_min_lr, {num_cycles: 2} for cosine_with_restarts."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    """Micro-batches (one row per rank each) per optimizer step. An asynchronous step that is full takes one more
    when samples at their last trainable version would otherwise be dropped (batch/overflow_micro_batch_count)."""
    num_iterations: int = 1
    """Optimizer passes over each step's samples (TRL's num_iterations, GRPO's mu), each pass's ratio against the
    sampler's log-probabilities (pi_old). A step is still one batch: max_steps, save_steps, warmup_steps, the
    learning-rate schedule and weight syncs count steps, not passes."""
    samples_per_step: int | None = None
    """null: a step is gradient_accumulation_steps micro-batches of token-budget rows, however many samples fill
    them (the spec's steps). N: a step trains exactly N samples (rollouts, not groups: a group may be cut by drops),
    packed into as many rows as they take, gradients accumulated over them. Synchronous mode
    (staleness.max_staleness=0): each batch is N / sampling.num_generations whole groups, as TRL's batch size gives
    (N a multiple of the group size), dropped groups replaced under the same weights."""
    gradient_checkpointing: bool = True
    gradient_checkpointing_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of torch.utils.checkpoint.checkpoint for every layer (through transformers'
    gradient_checkpointing_enable), over asyncrl's {use_reentrant: false}."""
    logit_chunk_tokens: int | None = None
    """Trained tokens whose LM-head logits exist at once (their [tokens x vocabulary] float32 buffers bound a
    step's memory); null = as many as keep a buffer within 1 GiB (1,024 at Gemma 3's 262k vocabulary, 1,766 at
    Qwen3's 152k); 0 = all of a row's at once."""
    attention: str = "auto"
    """Attention backend of the packed forward (asyncrl/packing/attention.py): auto (sdpa on CPU, varlen on
    CUDA) | sdpa | varlen | cascade | flex | kernels."""
    warm_up: bool = True
    """On CUDA: one step on synthetic rows (one of the token budget, one short) before the first, its update thrown
    away. The layers compile there (while a launched server boots), and its measured memory decides what a vLLM on
    the same GPU gets (asyncrl/trainer/memory.py)."""
    compile_layers: str = "auto"
    """torch.compile the decoder layers: true | false | auto (on CUDA) | a torch.compile backend's name."""
    bf16: bool | None = None
    """None: bf16 mixed precision on GPU (unless trainer.fp16), off on CPU."""
    fp16: bool = False
    """float16 mixed precision for GPUs without bfloat16: forward and backward in float16 over float32 master weights,
    the loss scaled by torch.amp's GradScaler (a step whose gradients overflow is skipped and the scale lowered). GPU
    only, and not with trainer.bf16=true."""
    tf32: bool | None = None
    """TF32 for the trainer's float32 matmuls and convolutions on an Ampere or newer GPU (true) or IEEE float32
    (false), as transformers' TrainingArguments.tf32; null keeps torch's default (IEEE). true needs such a GPU."""
    optim: OptimizerName = OptimizerName.adamw_torch
    """adamw_torch | adamw_torch_fused (torch's fused kernel) | sgd | adagrad | rmsprop (torch's): each takes
    learning_rate and weight_decay, AdamW the adam_* keys too."""
    optim_args: str | None = None
    """The optimizer's other keywords as transformers' comma-separated key=value string: sgd takes momentum, dampening
    and nesterov (e.g. 'momentum=0.9,nesterov=true'), adagrad lr_decay and eps, rmsprop momentum, alpha, eps and
    centered, AdamW amsgrad (asyncrl/config/optim_args.py)."""
    optimizer_factory: str | None = None
    """Import path ('pkg.module:function') of the optimizer's factory, in place of trainer.optim and optim_args (TRL's
    optimizers=(optimizer, _), as a function since each trainer rank builds its own): called as
    function(named_parameters, config), with the trainable (name, parameter) pairs, FSDP2's sharded DTensors (build
    the optimizer over them as they are), and the run's Config (trainer.learning_rate and the like are yours to read),
    it returns a torch.optim.Optimizer. Its state must be in optimizer.state (checkpoints save it, resharded), and a
    step at learning rate 0 must leave the weights (the GPU warm-up's step)."""
    scheduler_factory: str | None = None
    """Import path ('pkg.module:function') of the learning-rate schedule's factory, in place of lr_scheduler_type and
    warmup_steps (TRL's optimizers=(_, scheduler)): called as function(optimizer, num_training_steps), with the run's
    optimizer and trainer.max_steps (required), it returns a torch.optim.lr_scheduler.LRScheduler of that optimizer,
    stepped once per optimizer step (not ReduceLROnPlateau, which reads a metric). Its state_dict() must hold tensors
    and plain values (a checkpoint's optimizer.pt loads with torch.load(weights_only=True))."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one training device at the training precision, for perf/*_mfu; None: asyncrl's table
    of GPUs (trainer/flops.py); MFU is not logged where neither knows the device."""
    gpus: int | None = None
    num_processes: int | None = None
    """Trainer ranks (FSDP2 data parallel) on each node; None: trainer.gpus on a GPU machine, else 1. On CPU (gloo)
    set it."""
    nnodes: int = 1
    """Nodes of the trainer. > 1: `asyncrl train` on the first node starts the server and that node's ranks (global
    rank 0 among them); every other node runs `torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d
    --rdzv-endpoint HOST:PORT --rdzv-id asyncrl -m asyncrl.trainer.rank_main RUN_DIR` with the run directory on a
    shared filesystem (examples/slurm/train.sbatch)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the ranks' c10d rendezvous (torchrun's --rdzv-endpoint), required with trainer.nnodes > 1: the
    first node's address that every node reaches, and a free port. None: a free loopback port (one node)."""
    cpu_threads: int | None = None
    """Trainer without a GPU: torch intra-op threads per rank; None: the cores that a launched built-in server on
    the CPU leaves (cores - server.cpu_threads), split over the ranks. More threads than free cores slow every op:
    each parallel region waits for the thread that shares its core with the server."""
    fsdp_cpu_offload: bool = False
    """With several ranks: keep the sharded parameters and optimizer state in CPU memory (FSDP2 offload)."""
    logging_steps: int = 1
    callbacks: list[str] = field(default_factory=list)
    """Import paths ('pkg.module:Class') of classes, each instantiated with no arguments, whose hooks the trainer calls
    on rank 0 only: on_step_end, on_log, on_evaluate, on_save (asyncrl/trainer/callbacks.py). A hook may set
    control.should_training_stop, and the run then ends as at max_steps."""
    save_strategy: str = "steps"
    """steps|no"""
    save_steps: int = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    """Checkpoints hold the model and tokenizer only (transformers' save_only_model): no optimizer, scheduler or RNG
    state and no sharded resume files, so they are smaller and faster to write but do not resume; a new run starts
    from one with model.name_or_path=CHECKPOINT (with LoRA: from `asyncrl export CHECKPOINT OUT`'s OUT)."""
    resume_from_checkpoint: str | None = None
    """latest | a checkpoint directory."""
    max_restarts: int = 0
    """A rank, rollout worker or generation server that dies (or stops answering: a weight sync or the generations
    fail) restarts the run from its newest good checkpoint, up to this many times (asyncrl/restart.py); 0: the run
    stops with the error."""


@dataclass
class DataConfig:
    path: str | None = None
    """Hub id, local directory, or a .json/.jsonl/.parquet file with a `prompt` column: conversational (a list of
    {role, content} messages, rendered with the chat template) or standard (plain text, tokenized as it is, its
    completions plain text too; no tools or environments then), as TRL's GRPO page allows; None: each
    rollout's environment (a single rollout.environment_factory) returns its prompt from reset(), and
    trainer.max_steps sets the run's length."""
    name: str | None = None
    """Dataset configuration name (datasets' `name`)."""
    split: str = "train"
    eval_path: str | None = None
    """Held-out prompts for the before/after accuracy (same forms as `path`); None = no evaluation."""
    eval_split: str = "train"
    num_eval_prompts: int = 200
    """The first N rows of the eval split are scored before and after training; 0 = no evaluation."""
    shuffle: bool = True
    """Seeded shuffle per epoch (seed = trainer.seed + epoch), reproduced on resume."""
    streaming: bool = False
    """Read the split as a stream (datasets' streaming=True, an IterableDataset), never whole: for a split too big
    to download or hold. Its length is unknown, so trainer.max_steps is required; each pass is shuffled in a buffer
    (shuffle_buffer_size); a resume reads and drops the rows consumed before it. Refused with
    retire_solved_after and a mapping of environments (both need every row); vLLM's context then needs
    max_prompt_length or server.max_model_len (the longest prompt cannot be measured). The eval split is streamed
    too: only its first num_eval_prompts rows are read."""
    shuffle_buffer_size: int = 1000
    """data.streaming with data.shuffle: rows the shuffle buffer holds (datasets' buffer_size); each pass draws from
    it at random, seeded by trainer.seed + pass."""
    max_prompt_length: int | None = None
    """Prompts longer than this (tokens) are skipped and counted."""
    retire_solved_after: int | None = None
    """Skip a prompt from now on once its last N groups were all solved (every rollout at the run's top reward:
    rollout/solved.py), as POLARIS drops easy samples; counted as rollout/retired_prompt_count. An epoch whose every
    prompt is retired ends the run as a success. null: keep every prompt."""


@dataclass
class RolloutConfig:
    loop_cls: str = "asyncrl.rollout.loop:AsyncRolloutLoop"
    """Import path of the AsyncRolloutLoop (sub)class run in the worker."""
    group_requests: bool = True
    """The rollouts that ask for the same turn at once (a group's first turn) share one server request of n
    completions (completion i draws from seed + i, as vLLM's child requests): the worker's CPU per request is what
    bounds the rate of short completions. false: one request per rollout (a server refusing n gets that anyway)."""
    score_queue_maxsize: int = 16
    """Generated groups waiting to be scored; a full queue blocks their generation tasks (rollout/score_block_s) and
    admission starts no new group until it has room."""
    score_concurrency: int = 4
    """Groups scored at once. A sync reward function runs in a thread, so it may run on several groups at the same
    time and must be thread-safe (as tools must); 1: one group at a time, in the order their generation finished."""
    max_consecutive_dropped_groups: int | None = 256
    """Stop the run, saying why (zero_std, too_few_scorable, failed, prompt_too_long, stale, oversize) and which
    rewards, once this many groups in a row gave nothing to train, after saving the model and a checkpoint; null:
    never stop."""
    stop_when_solved: bool = True
    """When those groups were all solved (every rollout scored the run's highest reward, and some rollout of the run
    scored less: rollout/solved.py), the task is done: the run says so, saves the model, evaluates and exits 0.
    false: end such a run as a stall like any other (exit 1)."""
    max_failed_group_fraction: float = 0.1
    """A group whose generation still fails after the client's retries is dropped (rollout/failed_group_count);
    the run stops, with the last error, once more than this fraction of the last 100 groups failed (0: at the
    first failure)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Free-form fields for a custom loop class (read as self.config.rollout.options)."""
    tools: list[str] = field(default_factory=list)
    """Import paths of tool functions (sync or async, type hints + Google docstring), called by __name__."""
    environment_factory: Any = None
    """Import path of an environment class/factory, or a mapping name -> import path routed by the dataset's
    `environment` column; one instance per rollout, its public methods are tools."""
    tool_call_format: str = "auto"
    """auto|hermes|llama3|deepseek_v3|glm4|qwen3_coder|functiongemma|gemma4|tiny: how tool calls are parsed from the
    model's output; auto reads the chat template (qwen3_coder: Qwen3.5, Qwen3.6 and Qwen3-Coder's <function=NAME>
    calls; gemma4: Gemma 4's <|tool_call>call:NAME{...}<tool_call|>)."""
    chat_template: str = "auto"
    """auto|keep|path to a .jinja file. auto: with tools or environments, a known family (Qwen3, DeepSeek-V3/R1,
    Llama 3.1-3.3) whose stock template is not prefix-preserving, or cannot render a turn of several tool calls, gets
    asyncrl's training-safe one, which checkpoints and the final model keep; keep: never swap (warn); a path: use that
    template. A template that cannot render a tool call and its result is refused at startup."""


@dataclass
class LoggingConfig:
    report_to: list[str] = field(default_factory=list)
    """Trackers through accelerate: tensorboard, wandb, trackio."""
    log_completions: bool = False
    num_completions_to_print: int | None = None
    log_multimodal: bool = True
    """The completions table (log_completions) carries each prompt's images as thumbnails in an ``images`` column
    (TRL's log_multimodal): a wandb or trackio image, PNG bytes in log_completions_hub_repo's files, a count on the
    console and in TensorBoard. false: the prompt's text alone (smaller logs for large images)."""
    log_unique_prompts: bool = False
    """The trackers' completions table (and log_completions_hub_repo's) keeps only the first completion of each prompt
    (TRL's log_unique_prompts; the console's table is unchanged). Needs log_completions and a tracker in report_to or
    log_completions_hub_repo."""
    log_completions_hub_repo: str | None = None
    """Hub dataset repository (owner/name, or name in the token's user's namespace) that each logging step's
    completions table goes to as data/step_N.parquet (TRL's log_completions_hub_repo), uploaded beside training and
    kept in <run_dir>/completions; public unless hub.hub_private_repo=true. Needs log_completions and a token that
    may write."""
    console: str = "auto"
    """auto|live|plain: live rich display when stdout is a terminal."""
    project: str = "asyncrl"
    profile_steps: list[int] = field(default_factory=list)
    """Optimizer steps (1-based) to capture with torch.profiler: <run_dir>/profile/step_N.{txt,trace.json}."""
    report: bool = True
    """Write <run_dir>/report/ (plots and an HTML page, `asyncrl report`) as the run ends: a second or two of CPU."""
    eval_steps: int | None = None
    """Also evaluate on the held-out prompts every N optimizer steps (eval/* in that step's metrics); null or 0:
    only before and after training. A multiple of staleness.weight_sync_steps (the server holds that step's
    weights)."""
    eval_on_save: bool = False
    """Also evaluate at each checkpoint's step; the checkpoint keeps the result, which a run resumed from it reports
    as its "before" instead of evaluating again."""


@dataclass
class HubConfig:
    """Pushing the trained model to the Hugging Face Hub as transformers' TrainingArguments do (asyncrl/hub_push.py)."""

    push_to_hub: bool = False
    """Push the final model (<output_dir>/model) to hub_model_id at the end of training, with a model card (README.md)
    holding the run's config and its held-out evaluation; the repository is created as the run starts. Needs a token
    with write access (hf auth login, or HF_TOKEN)."""
    hub_model_id: str | None = None
    """owner/name, or name in the token's user's namespace; null: the run's name (run_name, else its directory's)."""
    hub_strategy: HubStrategy = HubStrategy.every_save
    """end: the final model only. every_save: also each checkpoint's model, at the repository's root, as it is saved.
    checkpoint: that, and the newest checkpoint whole in last-checkpoint/ (resumable). all_checkpoints: that, and every
    checkpoint whole in checkpoints/step_N/, as in the run directory. Checkpoints upload beside training, never
    holding it up; one saved during an upload goes after it (under every_save and checkpoint only the newest)."""
    hub_private_repo: bool | None = None
    """Create the repository private; null: the Hub's default for the namespace (public for a user)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    reward_funcs: list[dict[str, Any]] = field(default_factory=list)
    """Reward functions, each {name: registered-name-or-import-path, **kwargs}, or reward models, {name: reward_model,
    path: CHECKPOINT} (a sequence classifier scored on the trainer's GPU: asyncrl/rewards/reward_model.py); their
    rewards are summed. The `reward` config group holds presets (reward=accuracy); set the list itself with
    reward_funcs=[...]."""
    reward_weights: list[float] | None = None
    """One weight per reward function, in reward_funcs order (TRL's GRPOConfig.reward_weights): the weighted sum is
    the reward the advantage and `reward` use; rewards/<name>/mean stay unweighted, gdpo weights each function's
    group z-score. An environment's or a rollout's own reward weighs 1. null: every function weighs 1."""
    loss: dict[str, Any] = field(default_factory=lambda: {"name": "score_centering"})
    advantage: dict[str, Any] = field(default_factory=lambda: {"name": "group_zscore"})
    packing: dict[str, Any] = field(default_factory=lambda: {"name": "flat"})
    run_name: str | None = None
