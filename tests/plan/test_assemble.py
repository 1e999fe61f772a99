"""Planning a run: the checks that need more than the config's own fields fail naming the key, before anything
starts, and the plan holds each derived decision once."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.flow import FlowControl
from asyncrl.plan.assemble import build_plan, placed, plan_run
from asyncrl.plan_file import read_plan, write_plan

BAD_INPUTS = [
    (["trainer.samples_per_step=63", "staleness.max_staleness=0", "sampling.num_generations=8"],
     "must be a multiple of sampling.num_generations=8 (a synchronous step trains whole groups): try "
     "trainer.samples_per_step=56"),
    (["staleness.max_staleness=0", "staleness.weight_sync_steps=2"], "staleness.weight_sync_steps"),
    (["server.max_lora_rank=4"], "server.max_lora_rank"),
    (["lora=default", "lora.sync=adapter", "server.max_loras=3"], "server.max_loras"),
    (["loss=score_centering", "sampling.num_sampler_logprobs=0"], "sampling.num_sampler_logprobs"),
    (["loss.name=not_a_loss"], "unknown loss 'not_a_loss'"),
    (["+loss.epsilon_hihg=0.3"], "epsilon_hihg"),
    (["reward_funcs=[{name: length, scal: 0.1}]"], "reward 'length' has no parameter 'scal' (has: target, scale)"),
    (["advantage.name=nope"], "advantage"),
    (["packing.name=nope"], "packing"),
    (["trainer.attention=flash9"], "trainer.attention: unknown attention 'flash9'"),
    (["trainer.compile_layers=yes"], "trainer.compile_layers='yes'"),
    (["+packing.attention=sdpa"], "packing.attention is now trainer.attention: set trainer.attention instead"),
    (["+packing.compile_layers=false"], "packing.compile_layers is now trainer.compile_layers"),
    (["loss.importance_sampling=tokn_mask"], "loss: loss 'clipped': importance_sampling='tokn_mask' must be one of"),
    (["packing.token_budget=0"], "packing: packing 'tree': token_budget=0 must be >= 1"),
    (["lora=default", "loss.beta=0.01", "loss.sync_ref_model=true"], "loss.sync_ref_model=true mixes the policy into"),
    (["rollout.loop_cls=nope"], "rollout.loop_cls"),
    (["server.weight_transfer=ipc", "trainer.num_processes=2"], "server.weight_transfer=ipc with 2 trainer ranks"),
    (["server=builtin", "server.quantization=fp8"], "server.quantization=fp8 is vLLM's: the built-in server cannot"),
    (["server=vllm", "server.max_model_len=512", "server.quantization=fp8", "server.dtype=float32"],
     "server.quantization=fp8 needs 16-bit serving (vLLM's quantized layers refuse server.dtype=float32)"),
    (["server=builtin", "+sampling.generation_kwargs.prompt_logprobs=1"],
     "sampling.generation_kwargs.prompt_logprobs: the built-in server does not support prompt_logprobs"),
    (["server=builtin", "+sampling.generation_kwargs.stopp=1"],
     "sampling.generation_kwargs.stopp: not a field the built-in server reads (it reads: prompt, model,"),
    (["server=vllm", "server.max_model_len=512", "+sampling.generation_kwargs.stopp=1"],
     "sampling.generation_kwargs.stopp: not one of vLLM's sampling parameters that asyncrl passes on (those: "
     "allowed_token_ids, bad_words, include_stop_str_in_output, prompt_logprobs, skip_special_tokens,"),
    (["server=builtin", "sampling.structured_outputs_regex='[0-9]+'"],
     "sampling.structured_outputs_regex is vLLM's guided decoding: the built-in server cannot hold its sampling"),
    (["trainer.lr_scheduler_type=cosine_with_min_lr", "trainer.max_steps=10"],
     "trainer.lr_scheduler_kwargs={} for trainer.lr_scheduler_type=cosine_with_min_lr: One of min_lr or min_lr_rate"),
    (["trainer.lr_scheduler_type=cosine", "trainer.max_steps=10", "+trainer.lr_scheduler_kwargs={min_lr_rate: 0.1}"],
     "trainer.lr_scheduler_kwargs={'min_lr_rate': 0.1} for trainer.lr_scheduler_type=cosine: "
     "get_cosine_schedule_with_warmup() got an unexpected keyword argument 'min_lr_rate'"),
    (["trainer.gradient_checkpointing=true", "+trainer.gradient_checkpointing_kwargs={reentrant: false}"],
     "trainer.gradient_checkpointing_kwargs.reentrant: torch.utils.checkpoint.checkpoint takes no such argument "
     "(it takes use_reentrant, context_fn, determinism_check, debug, early_stop, preserve_rng_state)"),
    (["trainer.callbacks=[my_pkg.callbacks:Stop]"], "trainer.callbacks: cannot import module 'my_pkg.callbacks'"),
    (["server=builtin", "server.model_impl=vllm"],
     "server.model_impl=vllm asks for vLLM's implementation of the model, and the built-in server runs transformers'"),
    (["trainer.optimizer_factory=my_pkg.optim:build"],
     "trainer.optimizer_factory: cannot import module 'my_pkg.optim'"),
    (["trainer.scheduler_factory=asyncrl.rewards.format:boxed_format", "trainer.max_steps=10"],
     "trainer.scheduler_factory: 'asyncrl.rewards.format:boxed_format' cannot be called as "
     "function(optimizer, num_training_steps)"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "named"), BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_input_fails_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as info:
        plan_run(compose(overrides))
    assert named in str(info.value)


def test_a_synchronous_run_trains_whole_groups_of_samples_per_step():
    config = plan_run(compose(["trainer.samples_per_step=16", "staleness.max_staleness=0",
                               "sampling.num_generations=8"])).config  # fmt: skip
    assert FlowControl.from_config(config).batch_groups == 2


def test_reward_by_import_path():
    config = plan_run(compose(["reward_funcs=[{name: 'asyncrl.rewards.accuracy:accuracy'}, {name: length}]"])).config
    assert [f["name"] for f in config.reward_funcs] == ["asyncrl.rewards.accuracy:accuracy", "length"]


def test_vllm_takes_its_sampling_parameters_and_a_regex_as_trl_users_set_them():
    overrides = ["server=vllm", "server.max_model_len=512", "sampling.structured_outputs_regex='[0-9]+'",
                 "+sampling.generation_kwargs={stop: [END], skip_special_tokens: false, bad_words: [um]}"]  # fmt: skip
    sampling = plan_run(compose(overrides)).config.sampling
    assert sampling.generation_kwargs == {"stop": ["END"], "skip_special_tokens": False, "bad_words": ["um"]}
    assert sampling.structured_outputs_regex == "[0-9]+"


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the ranks of a machine without CUDA")
def test_the_rank_count_is_decided_once_and_ipc_is_checked_against_it():
    """trainer.gpus counts ranks only where CUDA is: the plan, its ipc check and the launcher agree (the check
    once counted 2 ranks here, where the launcher starts 1)."""
    plan = plan_run(compose(["trainer.gpus=2", "server.weight_transfer=ipc"]))
    assert (plan.ranks_per_node, plan.world_size) == (1, 1)  # no CUDA: one rank
    assert plan.flow.max_staleness == plan.config.staleness.max_staleness
    nodes = to_config(compose(["trainer.num_processes=2", "trainer.nnodes=2", "trainer.rdzv_endpoint=node001:29400"]))
    assert build_plan(nodes).world_size == 4


def test_a_jobs_plan_decides_its_output_and_private_weights_directories_and_the_launcher_only_creates_them(tmp_path):
    """launch.py changes nothing of a plan's config: the plan of a job names its output directory and, for a server
    it launches without server.weights_dir, a private weights directory that the launcher creates (this user's
    only) and removes at exit."""
    import shutil

    from asyncrl.launch import claim_server_access

    plan = plan_run(compose([]), tmp_path)
    private = plan.private_weights_dir
    assert plan.config.trainer.output_dir == str(tmp_path)
    assert private is not None and plan.config.server.weights_dir == str(private)
    assert private.name.startswith("asyncrl-transfer-") and not private.exists()
    claim_server_access(plan)
    try:
        assert private.is_dir() and private.stat().st_mode & 0o777 == 0o700
        claim_server_access(plan)  # every replica's command claims: the same directory
        assert plan.config.server.weights_dir == str(private)
    finally:
        shutil.rmtree(private)  # its exit handler then finds nothing

    named = plan_run(compose([f"server.weights_dir={tmp_path / 'w'}", "trainer.output_dir=elsewhere"]), tmp_path)
    assert named.private_weights_dir is None and named.config.trainer.output_dir == "elsewhere"
    attached = plan_run(compose(["server.launch=false", "server.base_url=http://127.0.0.1:9"]), tmp_path)
    assert attached.private_weights_dir is None and attached.config.server.weights_dir is None
    assert plan_run(compose([])).private_weights_dir is None  # not a job's plan: `asyncrl config`, the ranks


@pytest.mark.skipif(torch.cuda.is_available(), reason="the built-in server on a machine without CUDA")
def test_the_plan_decides_the_backend_serving_dtype_and_merged_syncs_once():
    plan = plan_run(compose(["model.dtype=float32"]))
    assert (plan.server_backend, plan.serving_dtype, plan.adapter_sync) == ("builtin", "float32", False)
    assert plan_run(compose(["lora=default", "lora.sync=auto"])).adapter_sync is None  # the server's limits decide
    assert plan_run(compose(["lora=default", "lora.sync=merged"])).adapter_sync is False
    assert plan_run(compose(["server=vllm", "server.max_model_len=512"])).server_backend == "vllm"
    vllm_lora = ["lora=default", "lora.sync=auto", "server=vllm", "server.max_model_len=512"]
    assert plan_run(compose(vllm_lora)).adapter_sync is False  # the vLLM asyncrl launches has no LoRA under auto
    attached = ["server.launch=false", "server.base_url=http://127.0.0.1:9"]
    assert plan_run(compose([*vllm_lora, *attached])).adapter_sync is None  # one its user started may have
    assert plan_run(compose([*vllm_lora, "server.extra_args=[--enable-lora]"])).adapter_sync is None
    assert plan_run(compose([*vllm_lora, "lora.sync=adapter"])).adapter_sync is None  # launched with LoRA


def test_a_jobs_plan_fetches_the_config_json_its_serving_dtype_reads(tmp_path, monkeypatch):
    """A GPU server's dtype reads the checkpoint's config.json: a job fetches it before deciding when only the Hub
    has it, as a launched vLLM would; a plan that is no job's fetches nothing, and neither does one whose dtype is
    set or whose Hub does not answer."""
    fetched: list[str] = []
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda repo, name, **_: fetched.append(f"{repo}/{name}"))
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: None)  # the tests run offline (conftest.py)
    vllm = [
        "server=vllm",
        "server.max_model_len=512",
        "server.launch=false",
        "server.base_url=http://127.0.0.1:9",
        "model.name_or_path=nobody/uncached",
    ]
    plan_run(compose(vllm))
    assert fetched == []
    plan_run(compose([*vllm, "server.dtype=bfloat16"]), tmp_path / "set")
    assert fetched == []
    plan_run(compose(vllm), tmp_path / "job")
    assert fetched == ["nobody/uncached/config.json"]
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: "no answer")  # no wait through the Hub's retries
    plan_run(compose(vllm), tmp_path / "offline")
    assert fetched == ["nobody/uncached/config.json"]


def test_fp16_on_a_machine_without_a_gpu_fails_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        plan_run(compose(["trainer.fp16=true"]))
    assert str(info.value).startswith("trainer.fp16=true: float16 mixed precision with loss scaling runs on a CUDA GPU")


def test_a_jobs_plan_sizes_vllms_context_once_and_its_command_reads_it(tmp_path, monkeypatch, random_tiny_model_dir):
    """The launcher measures the prompts as it plans (plan/decide.py::max_model_len); plan.json carries the figure to
    the trainer's warm-up and a restart, and the vLLM command takes it: nothing measures again."""
    from asyncrl.serving.command import builtin_command
    from asyncrl.serving.vllm import vllm_command

    measured: list[str] = []
    monkeypatch.setattr("asyncrl.prompts.longest_prompt_tokens", lambda config, *_: measured.append("once") or 100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a launched vLLM's plan is placed on GPUs
    vllm = ["server=vllm", f"model.name_or_path={random_tiny_model_dir}", "server.vllm_version=0.33.0"]
    plan = plan_run(compose(vllm), tmp_path)
    assert plan.max_model_len == 100 + plan.config.sampling.max_completion_length and measured == ["once"]
    write_plan(plan, tmp_path)
    assert read_plan(tmp_path).max_model_len == plan.max_model_len
    assert plan.server_commands is not None and plan.server_commands[0] == vllm_command(plan)  # the job's, decided
    argv = vllm_command(plan, version="0.33.0").argv
    assert argv[argv.index("--max-model-len") + 1] == str(plan.max_model_len) and measured == ["once"]
    unsized = placed(plan_run(compose(vllm)), ["0", "1"])  # not a job's plan (`asyncrl config`): nothing measured
    assert unsized.max_model_len is None and measured == ["once"]
    with pytest.raises(ValueError, match="sized"):
        vllm_command(unsized, version="0.33.0")
    builtin = plan_run(compose(["server=builtin"]), tmp_path / "builtin")
    assert builtin.max_model_len is None  # its model's context
    assert builtin.server_commands == [builtin_command(builtin)]
    attached = ["server.launch=false", "server.base_url=http://127.0.0.1:9"]
    assert plan_run(compose(attached), tmp_path / "attached").server_commands is None  # its user started it


def test_an_attached_servers_needed_context_comes_from_the_prompts_measured_once(tmp_path, monkeypatch):
    """The launcher measures the prompts for an attached server that may be a vLLM (server.backend auto or vllm): the
    checks each rank makes against it read plan.json's figure. One named built-in measures nothing."""
    measured: list[str] = []
    monkeypatch.setattr("asyncrl.prompts.longest_prompt_tokens", lambda config, *_: measured.append("once") or 100)
    attached = ["server.launch=false", "server.base_url=http://127.0.0.1:9", "sampling.max_completion_length=64"]
    plan = plan_run(compose(attached), tmp_path)
    write_plan(plan, tmp_path)
    assert read_plan(tmp_path).prompt_tokens == 100 and measured == ["once"]
    assert (plan.needed_context("vllm"), plan.needed_context("builtin")) == (164, 65)
    builtin = plan_run(compose([*attached, "server.backend=builtin"]), tmp_path / "builtin")
    assert builtin.prompt_tokens is None and measured == ["once"] and builtin.needed_context("builtin") == 65
    fixed = plan_run(compose([*attached, "server.max_model_len=300"]), tmp_path / "fixed")
    assert fixed.prompt_tokens is None and fixed.needed_context("vllm") == 300 and measured == ["once"]


def test_model_impl_vllm_is_refused_where_server_auto_resolves_to_the_builtin_server(monkeypatch):
    monkeypatch.setattr("asyncrl.plan.assemble.resolve_backend", lambda config: "builtin")  # a GPU machine too
    with pytest.raises(ConfigError, match=r"^server.model_impl=vllm asks for vLLM's implementation") as refused:
        plan_run(compose(["server=auto", "server.model_impl=vllm"]))
    assert "\n" not in str(refused.value)
