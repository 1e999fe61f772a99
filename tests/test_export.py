"""`asyncrl export`: a LoRA adapter merges into its base with the peft model's logits, a full model is re-saved in
the asked dtype, a run directory resolves to its final model or newest checkpoint, OUT is written atomically and
never clobbered unasked, and every error names the path and what is missing. A vision-language model's checkpoints
resume and export whole: the vision tower bit-identical, the processor config beside the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sharded import save
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from asyncrl.cli import app
from asyncrl.config.compose import compose, to_config
from asyncrl.export import ExportError, export, resolve_source
from asyncrl.trainer.checkpoint import TrainerState, load_checkpoint, source_processor_files
from asyncrl.trainer.distributed import build_sharded

INPUT_IDS = torch.tensor([[7, 20, 31, 42, 53, 11, 9, 64], [5, 6, 70, 71, 72, 73, 74, 75]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


@pytest.fixture(scope="module")
def adapter(random_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """An adapter saved the way checkpoints save it, with nonzero lora_B, and its peft model's logits."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    path = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(random_tiny_model_dir).save_pretrained(path)
    return path, logits(model.eval())


def test_a_merged_adapter_gives_the_peft_models_logits(adapter, random_tiny_model_dir, tmp_path):
    path, expected = adapter
    done = export(path, tmp_path / "merged", dtype="float32")
    assert done.model_dir == path and done.base == str(random_tiny_model_dir)
    tensors = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any("lora_" in name or "base_layer" in name for name in tensors)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32).eval()
    assert (logits(base) - expected).abs().max() > 1e-2  # the adapter changes the model
    assert (logits(merged) - expected).abs().max() <= 1e-5
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer.chat_template and tokenizer.eos_token == AutoTokenizer.from_pretrained(path).eos_token


def test_a_full_model_is_resaved_in_bfloat16(random_tiny_model_dir, tmp_path):
    done = export(random_tiny_model_dir, tmp_path / "out")
    assert done.base is None and done.dtype == "bfloat16"
    saved = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(random_tiny_model_dir / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16} and saved.keys() == original.keys()
    assert all(torch.equal(saved[name], original[name].to(torch.bfloat16)) for name in saved)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_a_multi_rank_checkpoint_exports_its_consolidated_model(random_tiny_model_dir, tmp_path):
    """The layout trainer/fsdp.py writes: sharded/ resume files, model.safetensors in the serving dtype, config."""
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.bfloat16)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000008"
    (checkpoint / "sharded").mkdir(parents=True)
    save_file({name: p.contiguous() for name, p in model.named_parameters()}, str(checkpoint / "model.safetensors"))
    model.config.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(random_tiny_model_dir).save_pretrained(checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 8, "num_processes": 2}))
    done = export(tmp_path / "run", tmp_path / "out", dtype="float32")
    assert done.model_dir == checkpoint and done.base is None
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (logits(exported) - logits(model.float().eval())).abs().max() == 0


def test_a_vision_language_checkpoint_resumes_and_exports_with_its_tower_bit_identical(
    random_tiny_vlm_dir, tmp_path, one_rank
):
    """Train a step, checkpoint, resume from it, train and checkpoint again, export: the text model moved, the
    vision tower (and the image-processor config vLLM loads) came through exactly as the source had them."""
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}", "trainer.learning_rate=1e-3"]))
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_vlm_dir)
    for step in (1, 2):
        model, optimizer, scheduler, resume = build_sharded(config, tmp_path / "run", one_rank)
        if resume is not None:
            load_checkpoint(resume, scheduler)
        model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
        optimizer.step()
        files = source_processor_files(config, model.config)
        path = save(tmp_path / "run", TrainerState(step, step, 0, 0, {}), model, tokenizer, optimizer, scheduler,
                    one_rank, processor_files=files)  # fmt: skip
        config.trainer.resume_from_checkpoint = str(path)
    export(tmp_path / "run", tmp_path / "out", dtype="float32")
    source = load_file(random_tiny_vlm_dir / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    tower = [name for name in source if name.startswith("model.visual.")]
    assert exported.keys() == source.keys() and tower
    assert all(torch.equal(exported[name], source[name]) for name in tower)
    assert not torch.equal(exported["model.language_model.norm.weight"], source["model.language_model.norm.weight"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "Qwen3_5ForConditionalGeneration"]  # fmt: skip
    processor = (random_tiny_vlm_dir / "preprocessor_config.json").read_bytes()
    assert (path / "preprocessor_config.json").read_bytes() == processor
    assert (tmp_path / "out" / "preprocessor_config.json").read_bytes() == processor


def fake_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_a_run_directory_resolves_to_its_final_model_else_its_newest_checkpoint(tmp_path):
    for step in (2, 10):
        fake_model(tmp_path / "checkpoints" / f"step_{step:06d}")
    (tmp_path / "checkpoints" / "step_000020.tmp").mkdir()  # an unfinished checkpoint is never picked
    assert resolve_source(tmp_path) == tmp_path / "checkpoints" / "step_000010"
    fake_model(tmp_path / "model")
    assert resolve_source(tmp_path) == tmp_path / "model"
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    assert resolve_source(checkpoint) == checkpoint


def test_missing_models_are_named(tmp_path):
    with pytest.raises(ExportError, match="nothing-here: no such directory"):
        resolve_source(tmp_path / "nothing-here")
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(ExportError, match=r"empty-run: no model to export: .* no model/ and no checkpoints/step_\*"):
        resolve_source(tmp_path / "empty-run")
    (tmp_path / "run" / "checkpoints" / "step_000003").mkdir(parents=True)
    with pytest.raises(ExportError, match=r"step_000003: checkpoint without a model \(no adapter_config.json"):
        resolve_source(tmp_path / "run")


def moved_adapter(adapter: tuple[Path, torch.Tensor], tmp_path: Path, base: str | None) -> Path:
    path = tmp_path / "adapter"
    shutil.copytree(adapter[0], path)
    adapter_config = json.loads((path / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = base
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


def test_a_missing_base_asks_for_base_which_then_works(adapter, random_tiny_model_dir, tmp_path):
    path = moved_adapter(adapter, tmp_path, str(tmp_path / "gone-base"))
    with pytest.raises(ExportError, match=r"adapter: base model '.*gone-base' not found .* --base PATH_OR_HUB_ID"):
        export(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["adapter"]
    done = export(path, tmp_path / "out", dtype="float32", base=str(random_tiny_model_dir))
    assert done.base == str(random_tiny_model_dir)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (logits(merged) - adapter[1]).abs().max() <= 1e-5


def test_an_adapter_without_its_base_name_asks_for_base(adapter, tmp_path):
    path = moved_adapter(adapter, tmp_path, None)
    with pytest.raises(ExportError, match=r"config.json: no base_model_name_or_path; give the base with --base"):
        export(path, tmp_path / "out")


def test_out_is_not_clobbered_and_not_the_source(random_tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    export(random_tiny_model_dir, out)  # an empty OUT is fine
    with pytest.raises(ExportError, match="out: exists and is not empty; pass --overwrite"):
        export(random_tiny_model_dir, out)
    with pytest.raises(ExportError, match="OUT must not be the source"):
        export(random_tiny_model_dir, random_tiny_model_dir, overwrite=True)
    with pytest.raises(ExportError, match="OUT must not be the source"):
        export(random_tiny_model_dir, random_tiny_model_dir.parent, overwrite=True)
    with pytest.raises(ExportError, match="dtype='int8' must be one of float32, bfloat16, float16"):
        export(random_tiny_model_dir, tmp_path / "other", dtype="int8")


def test_the_cli_exports_a_run_and_overwrites_only_when_asked(adapter, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(adapter[0], run / "checkpoints" / "step_000004")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    runner = CliRunner()
    refused = runner.invoke(app, ["export", str(run), str(out)])
    assert refused.exit_code == 2 and "pass --overwrite" in refused.output and (out / "stale.txt").is_file()
    result = runner.invoke(app, ["export", str(run), str(out), "--dtype", "float16", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert "step_000004" in result.output and "LoRA adapter merged" in result.output
    assert not (out / "stale.txt").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.float16}
