"""What one trainer process pays for running the same FSDP2 path as several ranks: fwd+bwd+clip+AdamW step of a
model unsharded against the same model ``fully_shard``ed over a world of one (trainer/fsdp.py, trainer/ranks.py).

Rows of --tokens random token ids through the model's plain forward, a log-softmax loss, gradient clipping and
one AdamW step, --steps times after --warmup; both modes in this process, the plain one first. On a GPU the
sharded model computes in bf16 with fp32 master weights (the trainer's MixedPrecisionPolicy) and the plain one
under bf16 autocast (what the one-process trainer ran before), so the GPU figure also compares those two.

    python benchmarks/single_rank.py                         # the embedded model on this machine's CPU
    python benchmarks/single_rank.py --shape qwen3-1.7b      # a random Qwen3-1.7B-shaped model (a GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl.assets import asset_path
from asyncrl.config.compose import compose, to_config
from asyncrl.trainer import fsdp
from asyncrl.trainer.ranks import Ranks

SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       layer_types=["full_attention"] * 28),
}  # fmt: skip
"""Overrides of the embedded model's config (whose own layer_types list is as long as its 2 layers)."""


def build(shape: str | None) -> torch.nn.Module:
    """The embedded model, or a random model of ``shape`` built from the embedded model's config class."""
    path = asset_path("tiny-arith")
    if shape is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(path, **SHAPES[shape])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def seconds_per_step(model: torch.nn.Module, tokens: int, steps: int, warmup: int, autocast: bool) -> float:
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    amp = torch.autocast(device.type, torch.bfloat16) if autocast else contextlib.nullcontext()

    def step() -> None:
        with amp:
            logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1).mean().backward()
        fsdp.clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    model = build(args.shape)
    sharded_copy = copy.deepcopy(model)
    plain = seconds_per_step(model.to("cuda") if gpu else model, args.tokens, args.steps, args.warmup, autocast=gpu)
    del model
    with Ranks.alone():
        config = to_config(compose([]))
        sharded = fsdp.shard(sharded_copy, config, torch.bfloat16 if gpu else None)
        shard_s = seconds_per_step(sharded, args.tokens, args.steps, args.warmup, autocast=False)
    where = torch.cuda.get_device_name() if gpu else f"CPU, {args.threads} thread(s)"
    print("| model | tokens/row | where | plain s/step | sharded (world of one) s/step | sharded / plain |")
    print("|---|---|---|---|---|---|")
    name = args.shape or "embedded"
    print(f"| {name} | {args.tokens} | {where} | {plain:.3f} | {shard_s:.3f} | {shard_s / plain:.2f} |")


if __name__ == "__main__":
    main()
