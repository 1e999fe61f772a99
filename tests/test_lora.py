"""LoRA with peft: the config becomes a LoraConfig, the trainer's model carries adapters, merged weights under
the base names or the adapter alone (a new name per version, a window of max_staleness + 1) reach the built-in
server (its logprobs then match the trainer's), and checkpoints hold the adapter and resume from it."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sharded import save, sharded
from transformers import AutoTokenizer

from asyncrl import lora
from asyncrl.client import Control, ControlClient, ServerError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.plan.assemble import build_plan
from asyncrl.serving.checks import ServerCheckError
from asyncrl.serving.command import served_name
from asyncrl.serving.process import ServerProcess, free_port
from asyncrl.trainer.checkpoint import TrainerState, load_checkpoint
from asyncrl.trainer.distributed import build_sharded
from asyncrl.trainer.model import load_model
from asyncrl.trainer.weight_sync import WeightSync, WeightSyncError, build_weight_sync
from asyncrl.weights.adapter import AdapterSync
from asyncrl.weights.file_transport import FileTransport
from asyncrl.weights.tensors import parameter_metadata, serving_parameters, unique_state_dict
from tests.conftest import served_vs_local


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


@pytest.mark.parametrize("targets", ["all-linear", "[qkv,q_proj]"])  # qkv: the vision tower's attention only
def test_a_vision_language_model_gets_adapters_on_its_text_model_only(random_tiny_vlm_dir, targets):
    model = load_model(lora_config(random_tiny_vlm_dir, f"lora.target_modules={targets}"), str(random_tiny_vlm_dir))
    adapted = [name for name, _ in model.named_modules() if name.endswith(".lora_A")]
    assert adapted and not any(".visual." in name for name in adapted)
    assert not any(p.requires_grad for name, p in model.named_parameters() if ".visual." in name)
    train_adapters(model, seed=3)
    assert not any(name.startswith("model.visual.") for name in unique_state_dict(model))  # merged sync


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.mark.parametrize("sync", ["merged", "auto"])
def test_merged_sync_makes_the_server_match_the_trainer(server, peft_model, random_tiny_model_dir, tmp_path, sync):
    name = served_name(str(random_tiny_model_dir))
    config = lora_config(random_tiny_model_dir, f"lora.sync={sync}")
    with ControlClient(server.base_url, timeout_s=60) as control:
        dtype = build_plan(config).serving_dtype
        sync_ = WeightSync(control, FileTransport.from_config(config=config, run_dir=tmp_path, dtype=dtype))
        sync_.init(peft_model)
        before = served_vs_local(server.base_url, peft_model, name)
        sync_.push(peft_model, 1)
        after = served_vs_local(server.base_url, peft_model, name)
        sync_.close()
    assert before > 1e-2 and after <= 1e-4, (before, after)


def test_checkpoint_holds_the_adapter_and_resumes_from_it(random_tiny_model_dir, peft_model, tmp_path, one_rank):
    """The sharded trainer's checkpoint: peft's adapter files (no base weights) and resume files holding the adapter
    and its optimizer state only; resuming puts the same adapter and optimizer state back on the base model."""
    config = lora_config(random_tiny_model_dir)
    model, optimizer, scheduler = sharded(config, peft_model)
    loss = sum(p.sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    optimizer.step()
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model_dir)
    state = TrainerState(step=3, model_version=3, prompt_index=12, prompts_consumed=12, extra={})
    path = save(tmp_path, state, model, tokenizer, optimizer, scheduler, one_rank)
    assert lora.is_adapter_dir(path) and not (path / "model.safetensors").exists()
    saved = load_file(path / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved)
    resume_files = sum(f.stat().st_size for f in (path / "sharded").iterdir())
    assert resume_files < 4 * 4 * sum(t.numel() for t in saved.values()) + 100_000  # fp32 adapter + Adam moments

    config.trainer.resume_from_checkpoint = str(path)
    resumed, new_optimizer, new_scheduler, resume = build_sharded(config, tmp_path, one_rank)
    assert resume == path and load_checkpoint(path, new_scheduler).model_version == 3
    assert [n for n, p in resumed.named_parameters() if p.requires_grad] == \
        [n for n, p in model.named_parameters() if p.requires_grad]  # fmt: skip
    resumed_state, trained_state = resumed.state_dict(), model.state_dict()
    assert all(torch.equal(resumed_state[name].to_local(), tensor.to_local()) for name, tensor in trained_state.items())
    step_of = {k: v["step"] for k, v in new_optimizer.state_dict()["state"].items()}
    assert step_of and all(float(step) == 1 for step in step_of.values())


def test_an_adapter_checkpoint_needs_lora_enabled(random_tiny_model_dir, peft_model, tmp_path):
    peft_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        load_model(to_config(compose([f"model.name_or_path={random_tiny_model_dir}"])), str(tmp_path))


@pytest.fixture(scope="module")
def lora_server(random_tiny_model_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """The built-in server with runtime LoRA, as asyncrl launches it for lora.sync=adapter and max_staleness=1."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(random_tiny_model_dir), "--port", str(port),
            "--served-model-name", served_name(str(random_tiny_model_dir)), "--device", "cpu", "--enable-lora",
            "--max-lora-rank", "8", "--max-loras", "3", "--weights-dir", str(weights_root)]  # fmt: skip
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=log, env={"OMP_NUM_THREADS": "1"},
                       startup_timeout_s=120) as process:  # fmt: skip
        yield process


class RecordingControl(ControlClient):
    """A ControlClient that records its adapter calls in order."""

    calls: list[tuple[str, str]]

    def load_lora_adapter(self, name: str, path: str) -> None:
        super().load_lora_adapter(name, path)
        self.calls.append(("load", name))

    def unload_lora_adapter(self, name: str) -> None:
        super().unload_lora_adapter(name)
        self.calls.append(("unload", name))


def adapter_config(model_dir: Path, output_dir: Path, sync: str = "adapter") -> Config:
    return lora_config(model_dir, f"lora.sync={sync}", "staleness.max_staleness=1", f"trainer.output_dir={output_dir}")


def planned_adapter_sync(control: Control, config: Config, output_dir: Path) -> AdapterSync:
    """Adapter-only sync with the flow rules and serving dtype the config's plan decides, as a run builds it."""
    plan = build_plan(config)
    return AdapterSync(control, config, output_dir, flow=plan.flow, dtype=plan.serving_dtype)


def test_adapter_sync_makes_the_server_match_the_trainer_under_the_new_name(
    lora_server, peft_model, random_tiny_model_dir, tmp_path
):
    config = adapter_config(random_tiny_model_dir, tmp_path)
    with ControlClient(lora_server.base_url, timeout_s=60) as control:
        sync = build_weight_sync(build_plan(config), control, tmp_path)
        assert isinstance(sync, AdapterSync)
        sync.init(peft_model)
        metrics = sync.push(peft_model, 1)
        served = served_vs_local(lora_server.base_url, peft_model, sync.name(1))
        base = served_vs_local(lora_server.base_url, peft_model, served_name(str(random_tiny_model_dir)))
        files = sorted(p.name for p in sync.path(1).iterdir())
        sync.close()
        assert [card["id"] for card in control.models()] == [served_name(str(random_tiny_model_dir))]
    assert served <= 1e-4 and base > 1e-2, (served, base)
    assert sync.name(1) == f"{sync.adapter_prefix}-v1" and sync.name(0) == served_name(str(random_tiny_model_dir))
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    full = (random_tiny_model_dir / "model.safetensors").stat().st_size
    assert 0 < metrics["perf/weight_sync_bytes"] < full / 10 and metrics["perf/weight_sync_s"] > 0
    assert not (tmp_path / ".vllm_lora").exists()


def test_the_window_keeps_max_staleness_plus_one_versions(lora_server, peft_model, random_tiny_model_dir, tmp_path):
    config = adapter_config(random_tiny_model_dir, tmp_path)
    with RecordingControl(lora_server.base_url, timeout_s=60) as control:
        control.calls = []
        sync = planned_adapter_sync(control, config, tmp_path)
        sync.init(peft_model)
        for version in (1, 2, 3):
            train_adapters(peft_model, seed=version)
            sync.push(peft_model, version)
        assert served_vs_local(lora_server.base_url, peft_model, sync.name(3)) <= 1e-4
        assert served_vs_local(lora_server.base_url, peft_model, sync.name(2)) > 1e-3  # v2 is still served as v2
        with pytest.raises(ServerError, match="does not exist"):
            served_vs_local(lora_server.base_url, peft_model, sync.name(1))
        assert sync.path(1).is_dir()  # unloaded at v3; its files go at the next sync
        sync.push(peft_model, 4)
        on_disk = sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir())
        calls = list(control.calls)
        sync.close()
    assert calls == [("load", sync.name(1)), ("load", sync.name(2)), ("load", sync.name(3)), ("unload", sync.name(1)),
                     ("load", sync.name(4)), ("unload", sync.name(2))]  # fmt: skip
    assert on_disk == [sync.name(2), sync.name(3), sync.name(4)]
    assert control.calls[len(calls) :] == [("unload", sync.name(3)), ("unload", sync.name(4))]


def test_lora_sync_auto_and_adapter_follow_what_the_server_can(lora_server, tiny_server, random_tiny_model_dir,
                                                               tmp_path):  # fmt: skip
    with ControlClient(lora_server.base_url, timeout_s=60) as control:
        assert isinstance(build_weight_sync(build_plan(adapter_config(random_tiny_model_dir, tmp_path, "auto")),
                                            control, tmp_path), AdapterSync)  # fmt: skip
        wide = lora_config(random_tiny_model_dir, "lora.sync=adapter", "lora.r=16", "staleness.max_staleness=1")
        with pytest.raises(ServerCheckError, match="--max-lora-rank 16"):
            build_weight_sync(build_plan(wide), control, tmp_path)
        many = lora_config(random_tiny_model_dir, "lora.sync=auto", "staleness.max_staleness=4")
        merged = build_weight_sync(build_plan(many), control, tmp_path)
        assert isinstance(merged, WeightSync)  # 3 < 4 + 2 adapters: merged
    with ControlClient(tiny_server.base_url, timeout_s=60) as control:
        assert isinstance(build_weight_sync(build_plan(adapter_config(random_tiny_model_dir, tmp_path, "auto")),
                                            control, tmp_path), WeightSync)  # fmt: skip
        with pytest.raises(ServerCheckError, match="LoRA off: restart it with --enable-lora"):
            build_weight_sync(build_plan(adapter_config(random_tiny_model_dir, tmp_path)), control, tmp_path)


def test_a_refused_load_fails_the_sync_naming_the_step(lora_server, peft_model, random_tiny_model_dir, tmp_path):
    config = lora_config(random_tiny_model_dir, "lora.sync=adapter", "staleness.max_staleness=3")  # keeps 4 of 3
    with ControlClient(lora_server.base_url, timeout_s=60) as control:
        sync = planned_adapter_sync(control, config, tmp_path)
        sync.init(peft_model)
        try:
            for version in (1, 2, 3):
                sync.push(peft_model, version)
            with pytest.raises(WeightSyncError, match="at load_lora_adapter: .*--max-loras 3"):
                sync.push(peft_model, 4)
        finally:
            sync.close()
        assert [card["id"] for card in control.models()] == [served_name(str(random_tiny_model_dir))]
    assert not (tmp_path / ".vllm_lora").exists()
