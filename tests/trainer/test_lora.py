"""LoRA with peft: the config becomes a LoraConfig, the trainer's model carries adapters, merged weights under
the base names reach the built-in server (its logprobs then match the trainer's), and checkpoints hold the
adapter and resume from it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from asyncrl.client import ControlClient
from asyncrl.config import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.trainer import lora
from asyncrl.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from asyncrl.trainer.model import build_optimizer, load_model
from asyncrl.trainer.sync.builtin import FileTransport
from asyncrl.trainer.sync.tensors import parameter_metadata, serving_parameters, unique_state_dict
from asyncrl.trainer.weight_sync import WeightSync, WeightSyncError

from .test_weight_sync import served_vs_local


def lora_config(model_dir: Path, *overrides: str) -> Config:
    return to_config(compose([f"model.name_or_path={model_dir}", "model.dtype=float32", "lora=default",
                              "lora.r=8", *overrides]))  # fmt: skip


def train_adapters(model: torch.nn.Module, seed: int) -> None:
    """Stand-in for training: lora_B starts at zero, so fresh adapters would change nothing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


@pytest.fixture
def peft_model(random_tiny_model_dir: Path) -> torch.nn.Module:
    model = load_model(lora_config(random_tiny_model_dir), str(random_tiny_model_dir))
    train_adapters(model, seed=1)
    return model.eval()


def test_the_lora_group_becomes_a_peft_config(tmp_path):
    config = lora_config(tmp_path, "lora.alpha=4", "lora.dropout=0.1", "lora.target_modules=[q_proj,v_proj]",
                         "lora.bias=lora_only", "lora.modules_to_save=[embed_tokens]")  # fmt: skip
    peft_config = lora.peft_config(config)
    fields = (peft_config.r, peft_config.lora_alpha, peft_config.lora_dropout, peft_config.bias)
    assert fields == (8, 4, 0.1, "lora_only")
    assert set(peft_config.target_modules) == {"q_proj", "v_proj"}
    assert peft_config.modules_to_save == ["embed_tokens"] and peft_config.task_type == "CAUSAL_LM"
    assert lora.peft_config(lora_config(tmp_path)).target_modules == "all-linear"


@pytest.mark.parametrize("override", ["lora.target_modules=[q_proj,lm_head]", "lora.modules_to_save=[lm_head]"])
def test_adapters_on_lm_head_are_refused(tmp_path, override):
    with pytest.raises(ValueError, match="lora.target_modules must not include lm_head"):
        lora.peft_config(lora_config(tmp_path, override))


def test_the_trainer_model_trains_only_the_adapters(random_tiny_model_dir):
    model = load_model(lora_config(random_tiny_model_dir), str(random_tiny_model_dir))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert lora.is_peft(model) and trainable and all(".lora_" in name for name in trainable)
    assert not any("lm_head.lora_" in name for name, _ in model.named_parameters())
    plain = load_model(to_config(compose([f"model.name_or_path={random_tiny_model_dir}"])), str(random_tiny_model_dir))
    assert not lora.is_peft(plain)


def test_save_strategy_no_with_lora_warns(random_tiny_model_dir):
    with pytest.warns(UserWarning, match="save_strategy=no"):
        load_model(lora_config(random_tiny_model_dir, "trainer.save_strategy=no"), str(random_tiny_model_dir))


def test_adapting_a_tied_embedding_is_refused(random_tiny_model_dir):
    config = lora_config(random_tiny_model_dir, "lora.modules_to_save=[embed_tokens]")
    with pytest.raises(ValueError, match="ties embed_tokens to lm_head"):
        load_model(config, str(random_tiny_model_dir))


@pytest.mark.parametrize("extra", [[], ["lora.modules_to_save=[norm]", "lora.target_modules=[q_proj,down_proj]"]])
def test_merged_weights_equal_peft_merge_under_base_names(random_tiny_model_dir, extra):
    model = load_model(lora_config(random_tiny_model_dir, *extra), str(random_tiny_model_dir))
    train_adapters(model, seed=2)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    sent = unique_state_dict(model)
    assert set(sent) <= set(expected) and set(expected) - set(sent) <= {"lm_head.weight"}  # tied to the embedding
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    assert not any(".lora_" in name or "base_layer" in name for name in sent)
    streamed = dict(serving_parameters(model, None))
    assert [(n, list(t.shape)) for n, t in streamed.items()] == [(n, s) for n, _, s in parameter_metadata(model, None)]
    assert all(torch.equal(streamed[name], sent[name]) for name in streamed)
    assert any(p.requires_grad for p in model.parameters()), "sending must not merge the trainer's model"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.mark.parametrize("sync", ["merged", "auto"])
def test_merged_sync_makes_the_server_match_the_trainer(server, peft_model, random_tiny_model_dir, tmp_path, sync):
    name = str(random_tiny_model_dir)
    config = lora_config(random_tiny_model_dir, f"lora.sync={sync}")
    with ControlClient(server.base_url, timeout_s=60) as control:
        sync_ = WeightSync(control, FileTransport.from_config(config=config, run_dir=tmp_path))
        sync_.init()
        before = served_vs_local(server.base_url, peft_model, name)
        sync_.push(peft_model, 1)
        after = served_vs_local(server.base_url, peft_model, name)
        sync_.close()
    assert before > 1e-2 and after <= 1e-4, (before, after)


def test_adapter_only_sync_is_refused_before_the_server_is_contacted(random_tiny_model_dir, tmp_path):
    from asyncrl.trainer.weight_sync import build_weight_sync

    config = lora_config(random_tiny_model_dir, "lora.sync=adapter")
    with pytest.raises(WeightSyncError, match="lora.sync=adapter: adapter-only sync is not implemented yet"):
        build_weight_sync(config, control=None, run_dir=tmp_path)  # type: ignore[arg-type]


def test_checkpoint_holds_the_adapter_and_resumes_from_it(random_tiny_model_dir, peft_model, tmp_path):
    config = lora_config(random_tiny_model_dir)
    optimizer, scheduler = build_optimizer(config, peft_model)
    loss = sum(p.sum() for p in peft_model.parameters() if p.requires_grad)
    loss.backward()
    optimizer.step()
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model_dir)
    state = TrainerState(step=3, model_version=3, prompt_index=12, prompts_consumed=12, extra={})
    path = save_checkpoint(tmp_path, state, peft_model, tokenizer, optimizer, scheduler, total_limit=None)
    assert lora.is_adapter_dir(path) and not (path / "model.safetensors").exists()
    saved = load_file(path / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved)

    resumed = load_model(config, str(path))
    new_optimizer, new_scheduler = build_optimizer(config, resumed)
    assert load_checkpoint(path, new_optimizer, new_scheduler).model_version == 3
    assert [n for n, p in resumed.named_parameters() if p.requires_grad] == \
        [n for n, p in peft_model.named_parameters() if p.requires_grad]  # fmt: skip
    resumed_state, trained_state = resumed.state_dict(), peft_model.state_dict()
    assert all(torch.equal(resumed_state[name], tensor) for name, tensor in trained_state.items())
    step_of = {k: v["step"] for k, v in new_optimizer.state_dict()["state"].items()}
    assert step_of and all(float(step) == 1 for step in step_of.values())


def test_an_adapter_checkpoint_needs_lora_enabled(random_tiny_model_dir, peft_model, tmp_path):
    peft_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        load_model(to_config(compose([f"model.name_or_path={random_tiny_model_dir}"])), str(tmp_path))
