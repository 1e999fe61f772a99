"""Supervised pretraining of the `tiny-arith` asset: deterministic SFT on arithmetic transcripts, then eval.

    python -m asyncrl.assets.pretrain --out asyncrl/assets/tiny-arith --device cuda

The SFT answers are right only `--p-correct` of the time; otherwise the last digit is swapped for another
digit. The model learns the arithmetic but spreads its answer over ten nearby numbers, so sampling at
temperature 1 solves about that fraction of prompts and GRPO can sharpen it quickly. Imports only torch,
transformers and tokenizers, so it runs on the GPU machine as is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from asyncrl.assets.arithmetic import MAX_OPERAND, Pair, Problem, build_row, is_correct, split_pairs, write_splits
from asyncrl.assets.tiny_model import build_model, build_tokenizer, save_tiny_model

IGNORE_INDEX = -100
MAX_NEW_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; every default is what made the shipped asset."""
    parser = sft_parser(__doc__, "model + tokenizer folder", "split folder (default: <out>/../arith)", steps=6000,
                        batch_size=512, lr=1e-3, warmup_steps=200, p_correct=0.35, n_train=4000, n_eval=1000,
                        eval_help="held-out pairs, also the eval split", log_every=500)  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    return checked_args(parser, argv)


def sft_parser(description: str | None, out_help: str, data_out_help: str, *, steps: int, batch_size: int, lr: float,
               warmup_steps: int, p_correct: float, n_train: int, n_eval: int, eval_help: str,
               log_every: int) -> argparse.ArgumentParser:  # fmt: skip
    """The flags every asset's SFT script takes (this one's and pretrain_vlm's), with that script's defaults."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    parser.add_argument("--data-out", type=Path, default=None, help=data_out_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup-steps", type=int, default=warmup_steps)
    parser.add_argument("--p-correct", type=float, default=p_correct, help="fraction of SFT answers that are right")
    parser.add_argument("--n-train", type=int, default=n_train, help="rows in the shipped train split")
    parser.add_argument("--n-eval", type=int, default=n_eval, help=eval_help)
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per eval prompt at temperature 1")
    parser.add_argument("--log-every", type=int, default=log_every)
    return parser


def checked_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed flags, refused in one line where a count that must be positive is not."""
    args = parser.parse_args(argv)
    if args.steps < 1 or args.log_every < 1:
        parser.error(f"--steps ({args.steps}) and --log-every ({args.log_every}) must be at least 1")
    return args


def noisy_answer(total: int, rng: random.Random, p_correct: float) -> int:
    """The right total with probability `p_correct`, else the total with its last digit swapped for another."""
    if rng.random() < p_correct:
        return total
    wrong_digit = rng.choice([d for d in range(10) if d != total % 10])
    return total - total % 10 + wrong_digit


class SftData:
    """Pre-tokenized prompts and answers, so building a batch is list concatenation."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, pairs: list[Pair], p_correct: float, seed: int):
        self.pairs = pairs
        self.p_correct = p_correct
        self.pad_id = tokenizer.pad_token_id
        self.prompt_ids = [prompt_ids(tokenizer, build_row(a, b)) for a, b in pairs]
        # The largest noisy answer is the largest total with its last digit swapped for 9.
        largest = 2 * MAX_OPERAND - 2 * MAX_OPERAND % 10 + 9
        boxed = [tokenizer.encode(f"\\boxed{{{n}}}", add_special_tokens=False) for n in range(largest + 1)]
        self.answer_ids = [ids + [tokenizer.eos_token_id] for ids in boxed]
        self.rng = random.Random(seed)

    def batch(self, size: int) -> dict[str, torch.Tensor]:
        """Right-padded batch; loss only on the answer tokens and the closing EOS."""
        sequences, labels = [], []
        for index in self.rng.choices(range(len(self.pairs)), k=size):
            a, b = self.pairs[index]
            answer = self.answer_ids[noisy_answer(a + b, self.rng, self.p_correct)]
            sequences.append(self.prompt_ids[index] + answer)
            labels.append([IGNORE_INDEX] * len(self.prompt_ids[index]) + answer)
        width = max(map(len, sequences))
        return {
            "input_ids": right_pad(sequences, width, self.pad_id),
            "attention_mask": right_pad([[1] * len(s) for s in sequences], width, 0),
            "labels": right_pad(labels, width, IGNORE_INDEX),
        }


def right_pad(rows: list[list[int]], width: int, value: int) -> torch.Tensor:
    """Stack ragged rows into one tensor, filling the right end with `value`."""
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def prompt_ids(tokenizer: PreTrainedTokenizerFast, row: Problem) -> list[int]:
    """Token ids of a row's prompt with the generation prompt, as the rollout worker renders it."""
    return list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False))


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rows: list[Problem],
    samples: int,
    greedy: bool,
    seed: int,
) -> dict[str, float]:
    """Accuracy of `samples` completions per row, plus the share of rows with mixed outcomes (GRPO signal)."""
    model.eval()
    torch.manual_seed(seed)
    if greedy:
        sampling = {"do_sample": False}
    else:
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    by_length: dict[int, list[int]] = {}
    prompts = [prompt_ids(tokenizer, row) for row in rows]
    for index, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(index)
    correct = [0] * len(rows)
    for indexes in by_length.values():
        # Equal-length prompts need no padding, so positions match what a server would use.
        input_ids = torch.tensor([prompts[i] for i in indexes for _ in range(samples)], device=model.device)
        mask = torch.ones_like(input_ids)
        output = model.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, **sampling)
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        for position, text in enumerate(texts):
            row_index = indexes[position // samples]
            correct[row_index] += is_correct(text, str(rows[row_index]["solution"]))
    model.train()
    mixed = sum(0 < c < samples for c in correct) / len(rows)
    return {"accuracy": sum(correct) / (samples * len(rows)), "mixed_frac": mixed}


def train(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    data: SftData,
    eval_rows: list[Problem],
    args: argparse.Namespace,
) -> float:
    """AdamW SFT for `args.steps` steps, logging greedy accuracy; returns the mean loss of the last log window."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    start, running = time.perf_counter(), 0.0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = {k: v.to(model.device) for k, v in data.batch(args.batch_size).items()}
        running += sft_step(model, optimizer, model(**batch).loss)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            window = (step % args.log_every) + 1
            greedy = evaluate(model, tokenizer, eval_rows[:200], 1, greedy=True, seed=args.seed)["accuracy"]
            elapsed_s = time.perf_counter() - start
            line = f"step {step + 1:6d}  loss {running / window:.4f}  greedy@200 {greedy:.3f}  {elapsed_s:7.1f}s"
            print(line, flush=True)
            last_loss, running = running / window, 0.0
    return last_loss


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """One update on ``loss``, gradients clipped to norm 1 (both assets' SFT); the loss's value."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def make_deterministic(device: str) -> None:
    """Same seed and device give the same weights: deterministic kernels, no TF32."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # the two-run hash check in README.md confirms it
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("pretrain: --device cuda but torch sees no GPU")


def main(argv: list[str] | None = None) -> None:
    """Write the splits, pretrain, evaluate, save the model and a record of how it was made."""
    args = parse_args(argv)
    make_deterministic(args.device)
    data_out = args.data_out or args.out.parent / "arith"
    split_paths = write_splits(data_out, args.seed, args.n_train, args.n_eval)
    train_pairs, eval_pairs = split_pairs(args.seed, args.n_eval)
    eval_rows = [build_row(a, b) for a, b in eval_pairs]
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    model.set_attn_implementation("eager")  # SDPA's fused CUDA backward kernels are not deterministic
    model.to(args.device)
    data = SftData(tokenizer, train_pairs, args.p_correct, args.seed)
    final_loss = train(model, tokenizer, data, eval_rows, args)
    results = {
        "greedy": evaluate(model, tokenizer, eval_rows, 1, greedy=True, seed=args.seed),
        "temperature_1": evaluate(model, tokenizer, eval_rows, args.eval_samples, greedy=False, seed=args.seed),
    }
    print_table(results, len(eval_rows), args.eval_samples)
    save_tiny_model(model, tokenizer, args.out)
    write_record(args, split_paths, final_loss, results)


def print_table(results: dict[str, dict[str, float]], n_prompts: int, eval_samples: int) -> None:
    """The accuracy table that README.md quotes."""
    print(f"\n{'decoding':<14}{'prompts':>8}{'samples':>8}{'accuracy':>10}{'mixed_frac':>12}")
    for name, result in results.items():
        samples = 1 if name == "greedy" else eval_samples
        print(f"{name:<14}{n_prompts:>8}{samples:>8}{result['accuracy']:>10.3f}{result['mixed_frac']:>12.3f}")


def write_record(args: argparse.Namespace, split_paths: dict[str, Path], final_loss: float, results: dict) -> None:
    """`pretrain.json` beside the weights: the flags, versions, device and accuracies that made them."""
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "splits": {k: str(v) for k, v in split_paths.items()},
        "final_loss": final_loss,
        "eval": results,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
    }
    (args.out / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
