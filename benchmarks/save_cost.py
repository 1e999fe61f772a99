"""What one periodic checkpoint costs the trainer: ``fsdp.save_weights`` (the sharded fp32 weights and AdamW state,
then the consolidated model in the serving dtype) of a model of a real checkpoint's shape, random weights, after one
AdamW step, in a world of one (on the GPU where there is one); each writer-thread count in turn (``fsdp.SAVE_THREADS``
is the trainer's).

    python benchmarks/save_cost.py                                  # Gemma-3-270M's shape, 1 and SAVE_THREADS writers
    python benchmarks/save_cost.py --threads 1,2,4,8 --repeats 2 --dir /tmp/save-cost

Prints a table row per thread count: seconds per save (the median of --repeats), the resume files' size and count.
The disk and the page cache decide the figure: compare thread counts within one run.

Session 41, Gemma-3-270M's shape, medians (each run in benchmarks/RESULTS.md): on an H100 machine one writer 6.4 s
over six saves (5.1-9.6), 8 writers 4.5 s over six (4.2-4.6); on this workplace's 2-core CPU machine 11.8 s (9.5-18.7)
and 8.0 s (6.7-10.4). The disk's write-back makes single saves vary 2x: compare medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from asyncrl.config.compose import compose, to_config
from asyncrl.trainer import fsdp
from asyncrl.trainer.checkpoint import SHARDED_DIR
from asyncrl.trainer.model import build_optimizer
from asyncrl.trainer.ranks import Ranks

SHAPES = {
    "gemma3-270m": lambda: Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                            vocab_size=262144),
    "tiny": lambda: Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=32, vocab_size=1000),
}  # fmt: skip
"""Configs of the real checkpoints' shapes (benchmarks/real_checkpoints.py builds the checkpoints themselves); tiny:
the test's."""


def trained_model(shape: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A random model of ``shape``, sharded as the trainer shards it (in the process group of ``Ranks.alone``),
    whose optimizer has stepped once (its AdamW state exists, as in every periodic save)."""
    config = to_config(compose([]))
    model = fsdp.shard(AutoModelForCausalLM.from_config(SHAPES[shape](), dtype=torch.float32), config, None)
    optimizer, _ = build_optimizer(config, model)
    device = next(model.parameters()).device  # a GPU's where there is one, as the trainer's (fsdp.shard)
    model(input_ids=torch.randint(0, 1000, (1, 16), device=device)).logits.float().mean().backward()
    optimizer.step()
    return model, optimizer


def seconds_per_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks, directory: Path,
                     threads: int, repeats: int) -> tuple[float, int, int]:  # fmt: skip
    """The median seconds of ``repeats`` saves by ``threads`` writers into ``directory`` (emptied before each), and
    the last one's resume files: bytes and count."""
    times = []
    for _ in range(repeats):
        shutil.rmtree(directory, ignore_errors=True)
        started = time.perf_counter()
        fsdp.save_weights(directory, model, optimizer, ranks, torch.bfloat16, resumable=True, threads=threads)
        times.append(time.perf_counter() - started)
    files = [f for f in (directory / SHARDED_DIR).iterdir() if f.is_file()]
    return statistics.median(times), sum(f.stat().st_size for f in files), len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-270m")
    parser.add_argument("--threads", default=f"1,{fsdp.SAVE_THREADS}", help="writer-thread counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dir", type=Path, help="where the saves go (default: a new temporary directory)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="save_cost-"))
    print("| shape | writer threads | s/save | resume files GB | files |")
    print("|---|---|---|---|---|")
    with Ranks.alone() as ranks:
        model, optimizer = trained_model(args.shape)
        for threads in (int(t) for t in args.threads.split(",")):
            folder = root / f"threads{threads}"
            seconds, size, count = seconds_per_save(model, optimizer, ranks, folder, threads, args.repeats)
            print(f"| {args.shape} | {threads} | {seconds:.2f} | {size / 1e9:.2f} | {count} |", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
