"""Cross-field validation on the config's own fields: every bad input fails before anything starts, naming the
key (the checks that need the components, servers or trainer: tests/plan/test_assemble.py)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config

BAD_INPUTS = [
    (["sampling.top_p=0.9"], "sampling.top_k"),
    (["sampling.min_p=0.05"], "sampling.top_k"),
    (["sampling.num_generations=1"], "sampling.num_generations"),
    (["sampling.temperature=0"], "sampling.temperature"),
    (["sampling.top_p=1.5", "sampling.top_k=10"], "sampling.top_p"),
    (["sampling.max_completion_length=0"], "sampling.max_completion_length"),
    (["trainer.learning_rate=-1e-6"], "trainer.learning_rate"),
    (["trainer.weight_decay=-0.1"], "trainer.weight_decay"),
    (["trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps"),
    (["trainer.num_iterations=0"], "trainer.num_iterations=0 must be >= 1"),
    (["sampling.num_generations_eval=0"], "sampling.num_generations_eval=0 must be >= 1"),
    (["trainer.samples_per_step=0"], "trainer.samples_per_step=0 must be >= 1"),
    (["trainer.samples_per_step=64", "trainer.gradient_accumulation_steps=2"], "trainer.gradient_accumulation_steps"),
    (["logging.eval_steps=3", "staleness.weight_sync_steps=2"], "logging.eval_steps=3 must be a multiple"),
    (["logging.eval_on_save=true", "trainer.save_steps=5", "staleness.weight_sync_steps=2"], "trainer.save_steps=5"),
    (["trainer.cpu_threads=0"], "trainer.cpu_threads"),
    (["server.cpu_threads=0"], "server.cpu_threads"),
    (["trainer.max_steps=-1", "trainer.num_train_epochs=0"], "trainer.max_steps"),
    (["trainer.lr_scheduler_type=cosine", "trainer.max_steps=-1"], "trainer.lr_scheduler_type"),
    (["logging.profile_steps=[0]"], "logging.profile_steps"),
    (["staleness.max_staleness=-1"], "staleness.max_staleness"),
    (["staleness.weight_sync_steps=0"], "staleness.weight_sync_steps"),
    (["staleness.max_concurrent_rollouts=0"], "staleness.max_concurrent_rollouts"),
    (["server.launch=false"], "server.base_url"),
    (["server.max_model_len=16"], "server.max_model_len"),
    (["server.health_timeout=0"], "server.health_timeout=0"),
    (["sampling.num_sampler_logprobs=50"], "server.max_logprobs"),
    (["lora=default", "lora.target_modules=[q_proj,lm_head]"], "lm_head"),
    (["lora=default", "server.max_lora_rank=16"], "lora.r"),
    (["lora=default", "lora.dropout=0.1", "model.disable_dropout=true"], "lora.dropout=0.1 with model.disable_dropout"),
    (["reward_funcs=[]"], "reward_funcs"),
    (["reward_weights=[1.0,0.5]"], "reward_weights=[1.0, 0.5] has 2 weights for 1 reward_funcs: give one per"),
    (["reward_weights=[nan]"], "reward_weights=[nan]: every weight must be a finite number"),
    (["trainer.save_total_limit=-1"], "trainer.save_total_limit"),
    (["trainer.save_total_limit=0"], "trainer.save_total_limit"),
    (["trainer.save_only_model=true", "trainer.max_restarts=2"], "trainer.save_only_model=true with trainer.max_re"),
    (["rollout.score_queue_maxsize=0"], "rollout.score_queue_maxsize"),
    (["rollout.max_consecutive_dropped_groups=0"], "rollout.max_consecutive_dropped_groups"),
    (["rollout.max_failed_group_fraction=1.5"], "rollout.max_failed_group_fraction"),
    (["data.retire_solved_after=0"], "data.retire_solved_after=0 must be >= 1 (null: never retire a prompt)"),
    (["data.path=null"], "data.path"),
    (["data.num_eval_prompts=-1"], "data.num_eval_prompts"),
    (["server.replicas=0"], "server.replicas=0 must be >= 1"),
    (["server.replicas=2", "server.launch=false", "server.base_url=http://a:1"], "server.base_urls=[...]"),
    (["server.launch=false", "server.base_url=http://a:1", "server.base_urls=[http://b:1]"], "keep one"),
    (["server.base_urls=[http://a:1]"], "server.base_urls attaches to running servers: set server.launch=false"),
    (["server.launch=false", "server.base_urls=[]"], "server.base_urls=[] lists no server"),
    (["server.replicas=2", "server.weight_transfer=ipc"], "server.weight_transfer=ipc with 2 servers"),
    (["trainer.nnodes=0"], "trainer.nnodes=0 must be >= 1"),
    (["trainer.nnodes=2"], "trainer.nnodes=2 needs trainer.rdzv_endpoint=HOST:PORT"),
    (["trainer.nnodes=2", "trainer.rdzv_endpoint=node001"], "trainer.rdzv_endpoint=node001 must be HOST:PORT"),
    (["sampling.repetition_penalty=1.1"], "(whatever loss.importance_sampling says, none included) would train it"),
    (["+sampling.generation_kwargs.frequency_penalty=0.5"], "generation_kwargs.frequency_penalty moves single tokens'"),
    (["+sampling.generation_kwargs.top_k=5"], "kwargs.top_k: asyncrl sets top_k on every request from sampling.top_k"),
    (["+sampling.generation_kwargs.max_tokens=5"], "from sampling.max_completion_length: set that instead"),
    (["+sampling.generation_kwargs.seed=5"], "kwargs.seed: asyncrl sets seed itself, on every request: remove it"),
    (["hub.push_to_hub=true", "hub.hub_model_id=a/b/c"], "hub.hub_model_id=a/b/c: Repo id must be in the form"),
    (["trainer.fp16=true", "trainer.bf16=true"], "trainer.fp16=true and trainer.bf16=true ask for two mixed"),
    (["logging.log_unique_prompts=true"], "logging.log_unique_prompts=true thins the completions table"),
    (
        ["logging.log_unique_prompts=true", "logging.report_to=[tensorboard]"],
        "set logging.log_completions=true and logging.report_to=[...]",
    ),
    (
        ["trainer.gradient_checkpointing=false", "+trainer.gradient_checkpointing_kwargs={use_reentrant: true}"],
        "trainer.gradient_checkpointing_kwargs={'use_reentrant': True} with trainer.gradient_checkpointing=false",
    ),
    (["+trainer.lr_scheduler_kwargs={num_cycles: 2}"], "trainer.lr_scheduler_type=constant takes none; drop them"),
    (
        [
            "data.path=null",
            "rollout.environment_factory=asyncrl.environments.counter:IncrementEnv",
            "trainer.max_steps=-1",
        ],
        "trainer.max_steps",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("overrides", "named"), BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_input_fails_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as info:
        to_config(compose(overrides))
    assert named in str(info.value)


def test_ten_or_more_bad_inputs_are_covered():
    assert len(BAD_INPUTS) >= 10


def test_an_unfrozen_vision_tower_is_refused_with_lora_in_one_line():
    with pytest.raises(ConfigError) as info:
        to_config(compose(["lora=default", "model.freeze_vision_tower=false"]))
    assert str(info.value) == (
        "model.freeze_vision_tower=false with lora.enabled=true: LoRA adapts the text model only and keeps the vision "
        "tower frozen; drop one of them (model.freeze_vision_tower=true, or lora.enabled=false)"
    )


def test_an_unfrozen_vision_tower_is_accepted_without_lora_whatever_the_checkpoint():
    """On the default text-only checkpoint there is nothing to unfreeze: nothing to refuse either."""
    assert not to_config(compose(["model.freeze_vision_tower=false"])).model.freeze_vision_tower


def test_top_p_with_top_k_is_accepted():
    config = to_config(compose(["sampling.top_p=0.9", "sampling.top_k=50"]))
    assert config.sampling.top_k == 50
