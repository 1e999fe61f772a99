"""The trainer's torch threads on the CPU: it keeps the cores the launched built-in server leaves, and more ranks
than cores is one warning. A
vision-language checkpoint loads whole and trains its text model only: the tower gets no gradient and no
optimizer state."""

from __future__ import annotations

import logging

import pytest
import torch
from packing.packing_samples import random_samples  # tests/packing
from transformers import PreTrainedTokenizerBase

from asyncrl.assets.model_families import build_model, hybrid_vlm_config
from asyncrl.assets.tiny_model import build_tokenizer
from asyncrl.config.compose import compose, to_config
from asyncrl.launch import warn_cpu_oversubscribed
from asyncrl.model_kind import non_text_prefixes
from asyncrl.packing import TreeRow
from asyncrl.plan.assemble import plan_run
from asyncrl.trainer.checkpoint import source_processor_files
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.model import (
    available_cores,
    build_optimizer,
    freeze_non_text,
    load_model,
    oversubscribed_cores,
    trainer_cpu_threads,
    use_cpu_threads,
)
from asyncrl.trainer.setup import load_tokenizer


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
    assert trainer_cpu_threads(to_config(compose(overrides)), world, cores) == threads


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
        use_cpu_threads(to_config(compose(["trainer.cpu_threads=3"])), world=1)  # not the tests' 1 (conftest.py)
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
    assert set(source_processor_files(config, model.config)) == {"preprocessor_config.json"}


def test_a_text_model_is_trained_whole(random_tiny_model_dir):
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}"]))
    model = load_model(config, str(random_tiny_model_dir))
    assert non_text_prefixes(model) == () and all(p.requires_grad for p in model.parameters())
    assert source_processor_files(config, model.config) == {}


def test_the_packed_forward_trains_a_vision_language_models_text_model_only():
    """The trainer's path on a VLM whose text model is all attention: one sample's packed log-probabilities equal
    the model's plain forward, and the backward reaches every text parameter and no tower parameter."""
    tokenizer = build_tokenizer()
    model = build_model(hybrid_vlm_config(tokenizer, layer_types=["full_attention"] * 4), tokenizer)
    plain = build_model(hybrid_vlm_config(tokenizer, layer_types=["full_attention"] * 4), tokenizer)
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
