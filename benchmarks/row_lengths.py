"""Does the trainer's compiled forward and backward compile again for a row length the warm-up did not run? (issue 36)

    python benchmarks/row_lengths.py --out $OUT                        # H200 (kit sourced): Qwen3-0.6B's widths
    python benchmarks/row_lengths.py --strict --out $OUT               # the same without compile_options' option
    python benchmarks/row_lengths.py --tiny --backend aot_eager        # CPU rehearsal

A random Qwen3-shaped model (float32 weights, bf16 autocast on CUDA, gradient checkpointing, training mode, as the
trainer holds it; 4 layers, since every layer runs the same compiled code) trains the warm-up's rows
(trainer/memory.py ``synthetic_rows`` at the 16k token budget: a full row and a short one) through ``packed_forward``
and a backward, with the decoder layers and epilogues compiled as the trainer compiles them; then a tree row of each
``--lengths`` budget. Per row it prints the tokens, the seconds and the graphs torch.compile made for it (dynamo's
``unique_graphs`` counter): after the warm-up every row should make none. ``--strict`` compiles without
``trainer/compile_options.py``'s options (Inductor's default mix-order reduction checks), to show what they remove.
Writes row_lengths[-strict].json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.packing.trie import TreeRow  # noqa: E402
from asyncrl.trainer import compile_options  # noqa: E402
from asyncrl.trainer.forward import packed_forward  # noqa: E402
from asyncrl.trainer.memory import synthetic_rows  # noqa: E402

WIDTHS = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=32768)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096)  # fmt: skip


def build_model(tiny: bool, layers: int, device: torch.device) -> torch.nn.Module:
    """Random weights in float32, gradient checkpointing on, training mode: the trainer's model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**(TINY if tiny else WIDTHS), num_hidden_layers=layers, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(device)
    model.gradient_checkpointing_enable()
    return model.train()


def row_of(budget: int, vocab: int, short: bool = False) -> object:
    """The warm-up's full row at ``budget`` tokens (or its short row): groups of 8 sharing a prompt."""
    rows = synthetic_rows(functools.partial(TreeRow, budget), min(256, budget // 4), 256, 8, vocab, top_k=0)
    return rows[-1] if short else rows[0]


def train_row(model: torch.nn.Module, row: object, backend: str, device: torch.device) -> dict[str, float]:
    """One row's forward and backward; its seconds and the graphs compiled meanwhile."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    started = time.perf_counter()
    with autocast:
        out = packed_forward(model, row, 1.0, compile_layers=backend)
    out.logprobs.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return {"tokens": row.num_forwarded, "seconds": time.perf_counter() - started,
            "graphs": counters["stats"]["unique_graphs"] - before}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny widths (CPU rehearsal)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager on the CPU)")
    parser.add_argument("--budget", type=int, default=16384, help="the warm-up's token budget")
    parser.add_argument("--lengths", default="3000,4000,4600,6000,9000,12000,2000,300", help="later rows' budgets")
    parser.add_argument("--strict", action="store_true", help="compile without compile_options' options")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.strict:
        compile_options.inductor_options = lambda backend: None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.tiny, args.layers, device)
    vocab = model.config.vocab_size
    rows = [("warm-up full", row_of(args.budget, vocab)), ("warm-up short", row_of(args.budget, vocab, short=True))]
    rows += [(f"budget {b}", row_of(int(b), vocab)) for b in args.lengths.split(",")]
    options = compile_options.inductor_options(args.backend)
    print(f"torch {torch.__version__}, backend {args.backend}, options {options}")
    print("| row | tokens | seconds | graphs compiled |\n|---|---|---|---|", flush=True)
    results = []
    for name, row in rows:
        result = {"row": name, **train_row(model, row, args.backend, device)}
        results.append(result)
        print(f"| {name} | {result['tokens']} | {result['seconds']:.2f} | {result['graphs']} |", flush=True)
    later = sum(r["graphs"] for r in results[2:])
    print(f"graphs compiled after the warm-up: {later}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "row_lengths-strict.json" if args.strict else "row_lengths.json"
        (args.out / name).write_text(json.dumps({"torch": torch.__version__, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
