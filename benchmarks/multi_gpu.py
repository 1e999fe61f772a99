"""FSDP2 trainer ranks, 1 vs N GPUs on the same rows: loss parity, trained tokens/s scaling, weight-gather time.

For each rank count (default 1 and 2) the trainer's own multi-rank code runs a few optimizer steps on the same
GRPO-shaped tree rows (same initial weights, same rows per step): rank 0 plans and scatters the rows and leads,
the other ranks are the trainer's ``Follower``. Reported per rank count: grad norm and loss of step 1 (parity:
they must agree across rank counts up to bf16 noise), the largest difference of the updated weights from the
1-rank run's relative to the update itself, median step time and trained tokens/s over the steps after the
first, and the weight-sync gather time (every parameter gathered and cast to bf16 as a weight sync does).

    python benchmarks/multi_gpu.py                     # 2-GPU machine: Qwen3-0.6B-shaped random weights, bf16
    python benchmarks/multi_gpu.py --tiny              # CPU rehearsal (gloo, float32): the same code path

Prints a table; with $OUT set, also writes $OUT/multi_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the ranks are spawned: they import asyncrl from the same checkout

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from asyncrl.config.compose import compose  # noqa: E402
from asyncrl.packing.trie import TreeRow  # noqa: E402
from asyncrl.plan.assemble import plan_run  # noqa: E402
from asyncrl.rollout.types import RolloutSample, TrainingSequence  # noqa: E402
from asyncrl.serving.process import free_port  # noqa: E402


def model_config(tiny: bool) -> Qwen3Config:
    if tiny:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1_000_000)  # fmt: skip


def grpo_rows(args: argparse.Namespace, vocab: int) -> list[Any]:
    """``args.rows`` tree rows of groups of 8 completions sharing a prompt, random tokens and advantages."""
    rng = random.Random(args.seed)
    rows, current = [], TreeRow(args.budget)
    group = 0
    while len(rows) < args.rows:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(args.prompt // 2, args.prompt))]
        for rollout in range(8):
            completion = [rng.randrange(vocab) for _ in range(rng.randint(args.completion // 8, args.completion))]
            tokens = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            logprobs = [0.0 if m == 0 else -rng.uniform(0.5, 8.0) for m in mask]
            sample = RolloutSample(sequence=TrainingSequence(tokens, mask, logprobs), advantage=rng.uniform(-1, 1),
                                   reward=0.0, group_id=group, row_index=group, prompt_index=group, model_version=0,
                                   rollout_id=f"{group}-{rollout}")  # fmt: skip
            if not current.fits(sample):
                rows.append(current)
                current = TreeRow(args.budget)
            current.add(sample)
        group += 1
    return [row.pack(0) for row in rows[: args.rows]]


def plan_for(model_dir: Path, args: argparse.Namespace, world: int) -> Any:
    # cispo: no ratio clipping of the gradient, so random sampler log-probabilities still give every token one
    plan = plan_run(compose([
        f"model.name_or_path={model_dir}", "data.path=unused.jsonl", f"trainer.num_processes={world}",
        f"model.dtype={'float32' if args.tiny else 'bfloat16'}", "trainer.learning_rate=1e-5",
        "trainer.gradient_checkpointing=true", "loss=cispo", f"trainer.bf16={'false' if args.tiny else 'true'}",
        "trainer.attention=auto", "trainer.compile_layers=false",
    ]))  # fmt: skip
    return plan


def rank_main(rank: int, world: int, port: int, model_dir: Path, rows: list[Any], args: argparse.Namespace,
              out: Path) -> None:  # fmt: skip
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist

    from asyncrl.losses.step import StepLoss
    from asyncrl.trainer import fsdp
    from asyncrl.trainer.distributed import Follower, build_sharded, split_rows, train_rows
    from asyncrl.trainer.ranks import Ranks

    plan = plan_for(model_dir, args, world)
    config, components = plan.config, plan.components
    ranks = Ranks.from_env()
    try:
        if rank != 0:
            Follower(plan, out, ranks).serve()
            return
        model, optimizer, scheduler, _ = build_sharded(config, out, ranks)
        loss = StepLoss(components.loss)
        steps = []
        for step in range(args.steps):
            started = time.perf_counter()
            placement = [list(range(start, start + world)) for start in range(0, len(rows), world)]  # row r -> rank r
            mine = ranks.command("step", split_rows(rows, placement, loss.norm(rows)))
            result = train_rows(model, loss, mine, ranks, config)
            grad_norm = float(fsdp.clip_grad_norm(model, config.trainer.max_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            per_row = [m for per_rank, _ in ranks.gather((result.metrics, result.totals)) for m in per_rank]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - started, "grad_norm": grad_norm,
                          "entropy": statistics.fmean(m["entropy"] for m in per_row)})  # fmt: skip
            if step == 0:
                ranks.command("model", [str(out / "after_step_1")] * world)
                fsdp.save_weights(out / "after_step_1", model, optimizer, ranks, torch.float32, resumable=False)
        gathers = []
        for _ in range(3):
            ranks.command("sync", [(torch.bfloat16, False)] * world)
            view = fsdp.GatheredModel(model, ranks, torch.bfloat16)
            started = time.perf_counter()
            for _name, _tensor in view.named_parameters():
                pass
            gathers.append(time.perf_counter() - started)
            view.done()
        ranks.command("stop")
        (out / "result.json").write_text(json.dumps({"steps": steps, "gather_s": gathers}))
    finally:
        dist.destroy_process_group()


def compare(base: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """max |other - reference| / max |reference - base| over the parameters."""
    diff = max(float((other[n] - reference[n]).abs().max()) for n in reference)
    update = max(float((reference[n] - base[n]).abs().max()) for n in reference)
    return diff / max(update, 1e-30)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="asyncrl-multi-gpu-"))
    try:
        return run_in(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_in(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    config = model_config(args.tiny)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(work / "model")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    rows = grpo_rows(args, config.vocab_size)
    trained = sum(r.num_trained for r in rows)
    results, reference = [], None
    for world in args.ranks:
        out = work / f"ranks_{world}"
        out.mkdir()
        mp.spawn(rank_main, args=(world, free_port(), work / "model", rows, args, out), nprocs=world)
        data = json.loads((out / "result.json").read_text())
        weights = load_file(str(out / "after_step_1" / "model.safetensors"))
        reference = reference or weights
        timed = [s["seconds"] for s in data["steps"][1:]] or [data["steps"][0]["seconds"]]
        step_s = statistics.median(timed)
        results.append({
            "ranks": world, "grad_norm_step1": data["steps"][0]["grad_norm"],
            "entropy_step1": data["steps"][0]["entropy"],
            "weights_vs_1_rank": compare(base, reference, weights), "step_s": step_s,
            "trained_tokens_per_s": trained / step_s, "gather_s": statistics.median(data["gather_s"]),
            "rows": len(rows), "trained_tokens": trained,
        })  # fmt: skip
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'ranks':>5} {'grad_norm@1':>12} {'entropy@1':>10} {'dW vs 1 rank':>13} {'step_s':>8} "
          f"{'trained tok/s':>14} {'scaling':>8} {'gather_s':>9}")  # fmt: skip
    base = results[0]["trained_tokens_per_s"]
    for r in results:
        tokens_s = r["trained_tokens_per_s"]
        print(f"{r['ranks']:>5} {r['grad_norm_step1']:>12.6f} {r['entropy_step1']:>10.5f} "
              f"{r['weights_vs_1_rank']:>13.2e} {r['step_s']:>8.3f} {tokens_s:>14.0f} {tokens_s / base:>8.2f} "
              f"{r['gather_s']:>9.3f}")  # fmt: skip
    print(f"({results[0]['rows']} rows, {results[0]['trained_tokens']} trained tokens per step; dW: max weight "
          "difference after step 1 relative to the largest update)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default: 1 and 2)")
    parser.add_argument("--rows", type=int, default=8, help="rows per step (the same for every rank count)")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per row")
    parser.add_argument("--prompt", type=int, default=1024, help="longest prompt")
    parser.add_argument("--completion", type=int, default=1024, help="longest completion")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny model, gloo, float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.budget, args.prompt, args.completion, args.steps = 256, 48, 48, min(args.steps, 3)
    if args.ranks is None:
        args.ranks = [1, 2]
    if not args.tiny and torch.cuda.device_count() < max(args.ranks):
        parser.error(f"--ranks {max(args.ranks)} needs as many GPUs, {torch.cuda.device_count()} visible")
    return args


def main() -> None:
    args = parse_args()
    results = run(args)
    print_table(results)
    out = os.environ.get("OUT")
    if out:
        Path(out, "multi_gpu.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
