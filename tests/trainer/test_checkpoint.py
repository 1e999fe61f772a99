"""Checkpoints on disk: a save replaces an existing one without a half-deleted directory under its final name,
leftovers of an interrupted save are never listed, and a resume refuses to interleave two histories or to turn a
vision-language checkpoint's model.freeze_vision_tower."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal

import numpy as np
import pytest
import torch
from sharded import save, sharded
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.compose import compose, to_config
from asyncrl.trainer.checkpoint import (
    ResumeError,
    TrainerState,
    check_checkpoint,
    check_no_later_checkpoints,
    check_vision_tower,
    list_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
)
from asyncrl.trainer.exits import terminate_on_sigterm
from asyncrl.trainer.setup import check_model_path


@pytest.fixture(scope="module")
def saver(random_tiny_model_dir, one_rank):
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}"]))
    model = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    model, optimizer, scheduler = sharded(config, model)
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model_dir)

    def saver(output_dir, step: int, limit: int | None = None, prompt_index: int = 0, done_after_index=(),
              model_only: bool = False):  # fmt: skip
        state = TrainerState(step=step, model_version=step, prompt_index=prompt_index, prompts_consumed=0, extra={},
                             done_after_index=list(done_after_index))  # fmt: skip
        return save(output_dir, state, model, tokenizer, optimizer, scheduler, one_rank, limit, model_only=model_only)

    return saver


def test_a_save_over_an_existing_step_replaces_it_whole(saver, tmp_path):
    saver(tmp_path, 5, prompt_index=1)
    root = tmp_path / "checkpoints"
    (root / "step_000007.tmp").mkdir()  # an interrupted save
    (root / "step_000005.old").mkdir()  # an interrupted replacement
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005"]
    final = saver(tmp_path, 5, prompt_index=2)
    assert json.loads((final / "rollout_state.json").read_text())["prompt_index"] == 2
    assert (final / "model.safetensors").is_file() and (final / "optimizer.pt").is_file()
    assert (final / "sharded").is_dir()
    assert sorted(p.name for p in root.iterdir()) == ["step_000005", "step_000007.tmp"]


def test_the_resume_files_are_written_by_several_threads_a_file_each(saver, tmp_path):
    """One writer thread (torch.distributed.checkpoint's default) made a 270M model's save 1.4x slower on an H100
    machine (fsdp.SAVE_THREADS); the resume from such files is test_optimizers' and test_distributed's."""
    from asyncrl.trainer.fsdp import SAVE_THREADS

    files = sorted(p.name for p in (saver(tmp_path, 2) / "sharded").iterdir())
    assert SAVE_THREADS > 1 and len([f for f in files if f.endswith(".distcp")]) == SAVE_THREADS
    assert ".metadata" in files


def test_a_resume_under_later_checkpoints_is_refused_before_anything_starts(saver, tmp_path):
    for step in (10, 20, 30):
        saver(tmp_path, step, limit=3)
    check_no_later_checkpoints(resolve_checkpoint("latest", tmp_path), tmp_path)
    older = tmp_path / "checkpoints" / "step_000010"
    with pytest.raises(ResumeError, match=r"at step 10 .* later checkpoints \(step_000020, step_000030\)"):
        check_no_later_checkpoints(older, tmp_path)
    check_no_later_checkpoints(older, tmp_path / "elsewhere")  # into a new run directory: nothing to mix with


def test_a_checkpoint_loads_with_weights_only_and_restores_every_rng(saver, random_tiny_model_dir, tmp_path):
    """optimizer.pt and rng_state.pt hold only tensors and plain values: torch.load(weights_only=True) reads them,
    so a checkpoint from someone else cannot run code, and the random streams continue where they were."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = saver(tmp_path, 4, prompt_index=7, done_after_index=[9, 12])
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for name in ("optimizer.pt", "rng_state.pt"):
        torch.load(path / name, weights_only=True)
    optimizer = torch.optim.AdamW(AutoModelForCausalLM.from_pretrained(random_tiny_model_dir).parameters())
    state = load_checkpoint(path, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    assert (state.step, state.prompt_index, state.done_after_index) == (4, 7, [9, 12])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_a_checkpoint_from_before_one_trainer_path_is_refused_in_one_line(saver, tmp_path):
    """Single-process checkpoints once held the model and the optimizer's state dict instead of sharded files."""
    import shutil

    path = saver(tmp_path, 2)
    check_checkpoint(path)
    shutil.rmtree(path / "sharded")
    with pytest.raises(ResumeError, match=r"no sharded/ resume files.* model.name_or_path="):
        check_checkpoint(path)


def test_a_model_only_checkpoint_is_a_model_directory_whose_resume_is_refused_in_one_line(saver, tmp_path):
    """trainer.save_only_model: no optimizer, scheduler, RNG or rollout state and no sharded resume files; the
    directory loads as a model (a new run's model.name_or_path), and a resume is refused as what it is, not as a
    damaged checkpoint."""
    path = saver(tmp_path, 3, model_only=True)
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.json"} <= names
    assert not names & {"optimizer.pt", "rng_state.pt", "rollout_state.json", "sharded"}
    AutoModelForCausalLM.from_pretrained(path)
    check_model_path(to_config(compose([f"model.name_or_path={path}"])))
    with pytest.raises(ResumeError) as refused:
        check_checkpoint(resolve_checkpoint("latest", tmp_path))
    assert str(refused.value) == (
        f"trainer.resume_from_checkpoint={path} holds the model only (saved with trainer.save_only_model=true), no "
        f"optimizer, scheduler or RNG state: start a new run from it with model.name_or_path={path}"
    )
    (path / "adapter_config.json").write_text("{}")  # a LoRA run's checkpoint holds the adapter alone
    with pytest.raises(ResumeError, match=rf"model.name_or_path=OUT after asyncrl export {path} OUT \(it holds a LoRA"):
        check_checkpoint(path)


def test_a_stop_signal_during_the_save_lands_after_the_checkpoint_is_published(saver, tmp_path, monkeypatch):
    """SIGTERM raised inside DCP's save came out as DCP's RuntimeError with the shards half written (a traceback and
    no resume command): held back, it is the run's KeyboardInterrupt once the checkpoint is whole."""
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", interrupted)
    previous = signal.getsignal(signal.SIGTERM)
    terminate_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            saver(tmp_path, 3)
    finally:
        signal.signal(signal.SIGTERM, previous)
    (final,) = list_checkpoints(tmp_path)
    check_checkpoint(final)
    assert final.name == "step_000003" and (final / "sharded").is_dir()


@pytest.mark.parametrize("trained", [True, False, None])  # None: written before the key, which froze the tower
def test_a_vision_language_checkpoint_resumes_under_the_freeze_vision_tower_it_trained_with(
    random_tiny_vlm_dir, random_tiny_model_dir, tmp_path, trained
):
    """Flipped, the trainer's tower and the server's would part (to true) or the optimizer would lack the tower's
    state (to false): refused in one line before anything loads. A text-only checkpoint has no tower to differ."""

    def checkpoint(model_dir, name):  # what the check reads: the model's config and trainer_state.json
        path = tmp_path / name
        path.mkdir()
        shutil.copy(model_dir / "config.json", path)
        extra = {} if trained is None else {"freeze_vision_tower": trained}
        state = {"step": 2, "model_version": 2, "prompts_consumed": 8, "extra": extra}
        (path / "trainer_state.json").write_text(json.dumps(state))
        return path

    vlm, text = checkpoint(random_tiny_vlm_dir, "vlm"), checkpoint(random_tiny_model_dir, "text")
    saved = "false" if trained is False else "true"
    for resumed in ("true", "false"):
        config = to_config(compose([f"model.freeze_vision_tower={resumed}"]))
        check_vision_tower(config, text)
        if resumed == saved:
            check_vision_tower(config, vlm)
            continue
        with pytest.raises(ResumeError) as refused:
            check_vision_tower(config, vlm)
        assert str(refused.value) == (f"trainer.resume_from_checkpoint={vlm} trained with model.freeze_vision_tower="
                                      f"{saved}: resume it with model.freeze_vision_tower={saved}, or start a new run "
                                      f"from its weights with model.name_or_path={vlm}")  # fmt: skip
