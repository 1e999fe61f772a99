"""The trainer's torch threads on the CPU: it keeps the cores the launched built-in server leaves, and more ranks
than cores is one warning. A vision-language checkpoint loads whole and trains its text model only: the tower gets
no gradient and no optimizer state, unless model.freeze_vision_tower=false trains it too. TRL's training-loop
options reach torch and transformers: trainer.optim, lr_scheduler_kwargs, gradient_checkpointing_kwargs, fp16,
tf32, disable_dropout."""

from __future__ import annotations

import logging

import pytest
import torch
from packing.packing_samples import make_sample, random_samples  # tests/packing
from sharded import sharded
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from asyncrl.assets.model_families import build_model
from asyncrl.assets.tiny_vlm import build_vlm_config, build_vlm_tokenizer
from asyncrl.config.compose import compose, to_config
from asyncrl.config.errors import ConfigError
from asyncrl.launch import warn_cpu_oversubscribed
from asyncrl.model_kind import non_text_prefixes
from asyncrl.packing import TreeRow
from asyncrl.packing.row import PackedRow
from asyncrl.plan.assemble import plan_run
from asyncrl.prompts import load_tokenizer
from asyncrl.rollout.types import PromptImages
from asyncrl.trainer.checkpoint import source_processor_files
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.model import (
    available_cores,
    build_grad_scaler,
    build_optimizer,
    disable_dropout,
    freeze_non_text,
    load_model,
    mixed_precision_dtype,
    oversubscribed_cores,
    trainer_cpu_threads,
    use_bf16,
    use_cpu_threads,
    use_tf32,
)


@pytest.mark.parametrize(
    ("overrides", "world", "cores", "threads"),
    [
        ([], 1, 2, 1),  # the embedded default on CI's 2 cores: one for the server, one for the trainer
        ([], 1, 16, 15),
        (["server.cpu_threads=4"], 2, 16, 6),  # the rest split over the ranks
        (["server.cpu_threads=4"], 8, 8, 1),  # at least one each
        (["server.launch=false", "server.base_url=http://10.0.0.2:8000"], 1, 16, 16),  # a server elsewhere
        (["server.backend=vllm"], 1, 16, 16),  # vLLM runs on a GPU
        (["server.device=cuda"], 1, 16, 16),
        (["trainer.cpu_threads=3"], 1, 16, 3),  # set: taken as is
    ],
)
def test_the_trainer_takes_the_cores_the_server_leaves(overrides, world, cores, threads):
    plan = plan_run(compose(overrides))
    assert trainer_cpu_threads(plan.config, world, cores, plan.server_backend) == threads


def test_more_ranks_than_cores_is_one_warning(caplog):
    assert oversubscribed_cores(2, 2) is None
    assert oversubscribed_cores(3, 2) == (
        "trainer.num_processes=3 is more than the 2 CPU core(s) here: the ranks take turns on them and each step "
        "waits for the slowest; set trainer.num_processes to 2 or fewer"
    )
    too_many = available_cores() + 1
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        warn_cpu_oversubscribed(plan_run(compose([f"trainer.num_processes={too_many}"])))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ([] if torch.cuda.is_available() else [oversubscribed_cores(too_many, available_cores())])


def test_the_threads_are_set_on_a_cpu_machine():
    before = torch.get_num_threads()
    try:
        use_cpu_threads(to_config(compose(["trainer.cpu_threads=3"])), world=1, backend="builtin")  # not conftest's 1
        assert torch.get_num_threads() == (before if torch.cuda.is_available() else 3)
    finally:
        torch.set_num_threads(before)


def test_a_vision_language_checkpoint_trains_its_text_model_only(random_tiny_vlm_dir):
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}"]))
    model = load_model(config, str(random_tiny_vlm_dir))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration" and non_text_prefixes(model) == ("model.visual.",)
    tower = {name: p for name, p in model.named_parameters() if name.startswith("model.visual.")}
    text = [p for name, p in model.named_parameters() if name not in tower]
    loaded = {name: p.detach().clone() for name, p in tower.items()}
    optimizer, _ = build_optimizer(config, model)
    ids = torch.tensor([[4, 30, 31, 32, 5, 6, 40, 41]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert tower and all(not p.requires_grad and p.grad is None for p in tower.values())
    assert all(p.grad is not None for p in text)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in optimizer.state} == {id(p) for p in text}  # no optimizer state for the tower
    assert all(torch.equal(p, loaded[name]) for name, p in tower.items())
    assert isinstance(load_tokenizer(config), PreTrainedTokenizerBase)  # the text tokenizer, not a processor
    assert set(source_processor_files(config, model.config)) == {"preprocessor_config.json", "processor_config.json"}


def test_a_text_model_is_trained_whole(random_tiny_model_dir):
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}"]))
    model = load_model(config, str(random_tiny_model_dir))
    assert non_text_prefixes(model) == () and all(p.requires_grad for p in model.parameters())
    assert source_processor_files(config, model.config) == {}


def test_the_packed_forward_trains_a_vision_language_models_text_model_only():
    """The trainer's path on a VLM whose text model is all attention: one sample's packed log-probabilities equal
    the model's plain forward, and the backward reaches every text parameter and no tower parameter."""
    tokenizer = build_vlm_tokenizer()
    model = build_model(build_vlm_config(tokenizer, layer_types=["full_attention"] * 4), tokenizer)
    plain = build_model(build_vlm_config(tokenizer, layer_types=["full_attention"] * 4), tokenizer)
    freeze_non_text(model)
    row = TreeRow(10_000)
    row.add(random_samples(seed=1, num_groups=1, max_group=2)[0])
    packed = row.pack(top_k=0)
    out = packed_forward(model, packed, temperature=1.0, attention="sdpa")
    with torch.no_grad():
        logits = plain(input_ids=packed.input_ids[None]).logits[0, packed.token_index]
    expected = logits.log_softmax(-1).gather(1, packed.target_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs.detach(), expected, atol=1e-5, rtol=0)
    out.logprobs.sum().backward()
    for name, param in model.named_parameters():
        assert (param.grad is None) == name.startswith("model.visual."), name


@pytest.mark.parametrize(
    ("optim", "optim_args", "kind", "options"),
    [
        ("adamw_torch", "null", torch.optim.AdamW,
         {"betas": (0.8, 0.9), "eps": 1e-6, "fused": None, "foreach": None, "amsgrad": False}),
        ("adamw_torch_fused", "null", torch.optim.AdamW, {"betas": (0.8, 0.9), "eps": 1e-6, "fused": True}),
        ("adamw_torch", "'amsgrad=true'", torch.optim.AdamW, {"betas": (0.8, 0.9), "amsgrad": True}),
        ("sgd", "null", torch.optim.SGD, {"momentum": 0}),
        ("sgd", "'momentum=0.9,nesterov=true'", torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "dampening": 0}),
        ("adagrad", "null", torch.optim.Adagrad, {"lr_decay": 0, "eps": 1e-10, "fused": None}),
        ("adagrad", "'lr_decay=0.01,eps=1e-8'", torch.optim.Adagrad, {"lr_decay": 0.01, "eps": 1e-8}),
        ("rmsprop", "null", torch.optim.RMSprop, {"momentum": 0, "alpha": 0.99, "eps": 1e-8, "centered": False}),
        ("rmsprop", "'momentum=0.9,alpha=0.95,centered=true'", torch.optim.RMSprop,
         {"momentum": 0.9, "alpha": 0.95, "centered": True}),
    ],
)  # fmt: skip
def test_trainer_optim_takes_transformers_names_and_steps_the_sharded_model(
    optim, optim_args, kind, options, random_tiny_model_dir, one_rank
):
    """Each choice is torch's optimizer with the trainer's rates and trainer.optim_args' keywords, over FSDP2's
    sharded parameters (the default, adamw_torch, is the AdamW asyncrl always built); Adagrad's and RMSprop's eps are
    torch's defaults, as transformers leaves them."""
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", f"trainer.optim={optim}",
                                f"trainer.optim_args={optim_args}", "trainer.learning_rate=1e-3",
                                "trainer.weight_decay=0.01", "trainer.adam_beta1=0.8", "trainer.adam_beta2=0.9",
                                "trainer.adam_epsilon=1e-6"]))  # fmt: skip
    model, optimizer, _ = sharded(config, load_model(config, str(random_tiny_model_dir)))
    assert type(optimizer) is kind and len(optimizer.param_groups) == 1
    assert optimizer.defaults["lr"] == 1e-3 and optimizer.defaults["weight_decay"] == 0.01
    assert {key: optimizer.defaults[key] for key in options} == options
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    ids = torch.tensor([[4, 30, 31, 32, 5, 6, 40, 41]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    assert all(not torch.equal(old, new) for old, new in zip(before, after, strict=True))


def test_lr_scheduler_kwargs_reach_transformers_schedule():
    """cosine_with_min_lr decays to min_lr_rate x the learning rate by trainer.max_steps (TRL's open-r1 recipes)."""
    config = to_config(compose(["trainer.learning_rate=1e-3", "trainer.lr_scheduler_type=cosine_with_min_lr",
                                "+trainer.lr_scheduler_kwargs={min_lr_rate: 0.1}",
                                "trainer.max_steps=10"]))  # fmt: skip
    optimizer, scheduler = build_optimizer(config, torch.nn.Linear(2, 2))
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([1e-4])


@pytest.mark.parametrize(("overrides", "keywords"), [
    ([], {"use_reentrant": False}),
    (["+trainer.gradient_checkpointing_kwargs={use_reentrant: true, preserve_rng_state: false}"],
     {"use_reentrant": True, "preserve_rng_state": False}),
])  # fmt: skip
def test_gradient_checkpointing_kwargs_reach_every_layers_checkpoint(overrides, keywords, random_tiny_model_dir):
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", "trainer.gradient_checkpointing=true",
                                *overrides]))  # fmt: skip
    model = load_model(config, str(random_tiny_model_dir))
    checkpoints = [m._gradient_checkpointing_func for m in model.modules() if getattr(m, "gradient_checkpointing", 0)]
    assert checkpoints and all(func.keywords == keywords for func in checkpoints)


def test_fp16_mixed_precision_replaces_the_default_bf16_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    default, fp16 = to_config(compose([])), to_config(compose(["trainer.fp16=true"]))
    assert (use_bf16(default), mixed_precision_dtype(default)) == (True, torch.bfloat16)
    assert (use_bf16(fp16), mixed_precision_dtype(fp16)) == (False, torch.float16)
    assert build_grad_scaler(fp16).is_enabled() and not build_grad_scaler(default).is_enabled()


def test_disable_dropout_makes_the_trained_forward_repeatable_and_leaves_the_saved_config(
    random_tiny_model_dir, tmp_path
):
    """A checkpoint with attention dropout: in train() mode (the trainer's) two forwards of the same tokens differ,
    unless model.disable_dropout; torch.nn.Dropout modules go to p=0 as well."""
    source = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir)
    source.config.attention_dropout = 0.5
    source.save_pretrained(tmp_path)
    ids = torch.tensor([[4, 30, 31, 32, 5, 6, 40, 41]])
    for disabled in (False, True):
        config = to_config(compose([f"model.name_or_path={tmp_path}", f"model.disable_dropout={disabled}"]))
        model = load_model(config, str(tmp_path)).train()
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits) == disabled
    assert model.config.attention_dropout == 0.5  # checkpoints keep the checkpoint's own dropout
    head = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3))
    disable_dropout(head)
    assert head[1].p == 0.0


@pytest.fixture
def torch_tf32():
    """torch's TF32 switches, put back as they were after the test."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_switches_torch_matmul_precision_on_an_ampere_gpu_and_true_is_refused_on_an_older_one(
    monkeypatch, torch_tf32
):
    """As transformers' TrainingArguments.tf32: true/false set TF32 on an Ampere or newer GPU, null leaves torch's
    default, true on an older GPU raises and false is a no-op there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))  # an H100
    on, off, default = (to_config(compose(o)) for o in (["trainer.tf32=true"], ["trainer.tf32=false"], []))
    use_tf32(on)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    use_tf32(default)
    assert torch.backends.cuda.matmul.allow_tf32
    use_tf32(off)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (7, 5))  # a T4
    with pytest.raises(ConfigError, match="trainer.tf32=true needs an NVIDIA GPU of the Ampere generation or newer"):
        use_tf32(on)
    use_tf32(off)


def test_cast_lm_head_to_fp32_refuses_a_head_tied_to_the_embeddings(random_tiny_model_dir):
    """As TRL: casting a tied head would cast the input embeddings with it."""
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", "model.cast_lm_head_to_fp32=true"]))
    with pytest.raises(ConfigError) as error:
        load_model(config, str(random_tiny_model_dir))
    assert str(error.value) == (f"model.cast_lm_head_to_fp32=true needs an LM head of its own, and "
                                f"{random_tiny_model_dir} ties it to the input embeddings (tie_word_embeddings): drop "
                                "model.cast_lm_head_to_fp32")  # fmt: skip


def image_row(model: torch.nn.Module) -> PackedRow:
    """A packed row of one sample whose prompt holds an image of 4x4 patches (random pixels), as the server
    renders it: its merged patches' placeholders between the vision start and end tokens."""
    config, vision = model.config, model.config.vision_config
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(16, features, generator=torch.Generator().manual_seed(0))
    images = PromptImages(pixels, torch.tensor([[1, 4, 4]]), config.image_token_id, vision.spatial_merge_size)
    image = [config.image_token_id] * (16 // vision.spatial_merge_size**2)
    prompt = [5, config.vision_start_token_id, *image, config.vision_end_token_id, 6]
    sample = make_sample(prompt + [10, 11, 12], len(prompt))
    sample.sequence.images = images
    row = TreeRow(10_000)
    row.add(sample)
    return row.pack(top_k=0)


@pytest.mark.parametrize("freeze", [True, False])
def test_model_freeze_vision_tower_decides_whether_an_image_row_trains_the_tower(random_tiny_vlm_dir, freeze):
    """The row's image runs through the tower either way: true (the default) keeps the tower as loaded, without
    gradients or optimizer state; false trains it with the text model."""
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}", f"model.freeze_vision_tower={freeze}"]))
    model = load_model(config, str(random_tiny_vlm_dir))
    tower = {name: p for name, p in model.named_parameters() if name.startswith("model.visual.")}
    loaded = {name: p.detach().clone() for name, p in tower.items()}
    optimizer, _ = build_optimizer(config, model)
    packed_forward(model, image_row(model), temperature=1.0, attention="sdpa").logprobs.sum().backward()
    optimizer.step()
    optimized = {id(p) for p in optimizer.state}
    assert tower and all(p.grad is not None for name, p in model.named_parameters() if name not in tower)
    for name, param in tower.items():
        trained = param.grad is not None and bool(param.grad.abs().sum() > 0) and id(param) in optimized
        assert param.requires_grad == trained == (not torch.equal(param, loaded[name])) == (not freeze), name


def test_model_freeze_vision_tower_false_has_nothing_to_unfreeze_on_a_text_model(random_tiny_model_dir):
    overrides = [f"model.name_or_path={random_tiny_model_dir}", "model.freeze_vision_tower=false"]
    model = load_model(to_config(compose(overrides)), str(random_tiny_model_dir))
    assert all(p.requires_grad for p in model.parameters())
