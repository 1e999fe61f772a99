"""Supervised pretraining of the `tiny-vlm` asset on the `shapes` task: SFT on noisy transcripts, then eval.

    python -m asyncrl.assets.pretrain_vlm --out asyncrl/assets/tiny-vlm

The model is ``tiny_vlm``'s random checkpoint (same architecture, seed, tokenizer and image processor), trained on
transcripts that answer "How many squares?". The answers of the first `--clean-steps` steps are all right, which
teaches the model to read the image; after them an answer is right only `--p-correct` of the time, else a miscount
by one. The model keeps reading the image but samples the right count about that often, so GRPO has a decision to
sharpen. (Noisy answers from the first step never taught it to read the image: the image signal they carry is
too weak.) A model that ignores the image can only guess: the splits' counts are balanced, so it scores 1 / MAX_COUNT.
Also writes the `shapes` splits (to `--data-out`, default `<out>/../shapes`).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from asyncrl.assets.arithmetic import is_correct
from asyncrl.assets.pretrain import checked_args, learning_rate, sft_parser, sft_step
from asyncrl.assets.shapes import MAX_COUNT, QUESTION, Layout, draw, split_layouts, write_splits
from asyncrl.assets.tiny_vlm import save_tiny_vlm

IGNORE_INDEX = -100
MAX_NEW_TOKENS = 6
"""`\\boxed{` digit `}` `<|end|>` and two to spare."""
PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
"""A row's prompt as the rollout worker renders it: the image part placed before the question."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; every default is what made the shipped asset."""
    parser = sft_parser(__doc__, "model folder (tiny_vlm's checkpoint, trained)",
                        "split folder (default: <out>/../shapes)", steps=1500, batch_size=32, lr=2e-3, warmup_steps=50,
                        p_correct=0.5, n_train=2000, n_eval=200, eval_help="held-out layouts, the eval split",
                        log_every=100)  # fmt: skip
    parser.add_argument("--clean-steps", type=int, default=500, help="first steps, whose answers are all right")
    parser.add_argument("--n-pool", type=int, default=20000, help="layouts the SFT draws from (none of eval's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads; 1 is fastest on a shared CPU")
    return checked_args(parser, argv)


class Shapes:
    """Turns layouts into model inputs: every prompt has the same tokens (one image of the same size), so a batch is
    the prompt repeated, the images' patches and, for SFT, each row's answer."""

    def __init__(self, model: Any, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = model.config.image_token_id
        rendered = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
        probe = image_processor(images=[draw(())], return_tensors="pt")["image_grid_thw"]
        per_image = int(probe.prod()) // image_processor.merge_size**2
        self.prompt = [
            t for token in rendered for t in ([token] * per_image if token == self.image_token_id else [token])
        ]
        self.answers = {n: tokenizer.encode(f"\\boxed{{{n}}}", add_special_tokens=False) + [tokenizer.eos_token_id]
                        for n in range(MAX_COUNT + 2)}  # fmt: skip

    def prompts(self, layouts: list[Layout], repeat: int = 1) -> dict[str, torch.Tensor]:
        """Each layout's prompt and image, ``repeat`` times in a row."""
        images = [draw(layout) for layout in layouts for _ in range(repeat)]
        processed = self.image_processor(images=images, return_tensors="pt")
        input_ids = torch.tensor([self.prompt] * len(images))
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "mm_token_type_ids": (input_ids == self.image_token_id).int(),
                "pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}  # fmt: skip

    def transcripts(self, layouts: list[Layout], answers: list[int]) -> dict[str, torch.Tensor]:
        """Prompts followed by their answers, the loss on the answers only (all answers have the same length)."""
        batch = self.prompts(layouts)
        answer_ids = torch.tensor([self.answers[n] for n in answers])
        batch["input_ids"] = torch.cat([batch["input_ids"], answer_ids], dim=1)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).int()
        batch["labels"] = torch.cat([torch.full((len(layouts), len(self.prompt)), IGNORE_INDEX), answer_ids], dim=1)
        return batch


def noisy_count(count: int, rng: random.Random, p_correct: float) -> int:
    """The right count with probability ``p_correct``, else a miscount by one either way (0 and MAX_COUNT + 1
    included): a wrong answer still depends on the image, so noisy transcripts teach reading it too."""
    if rng.random() < p_correct:
        return count
    return count + rng.choice((-1, 1))


@torch.no_grad()
def evaluate(model: Any, shapes: Shapes, layouts: list[Layout], samples: int, greedy: bool, seed: int) -> dict:
    """Accuracy of ``samples`` completions per layout, the share of layouts with mixed outcomes (GRPO's signal), and
    the share of answers that are the most common answer (about 1 / MAX_COUNT for answers that follow the balanced
    counts, 1 for a model that ignores the image and always answers the same)."""
    model.eval()
    torch.manual_seed(seed)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    correct, answers = [0] * len(layouts), {}
    for start in range(0, len(layouts), 50):
        chunk = layouts[start : start + 50]
        batch = shapes.prompts(chunk, repeat=samples)
        output = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, **sampling)
        texts = shapes.tokenizer.batch_decode(output[:, len(shapes.prompt) :], skip_special_tokens=True)
        for position, text in enumerate(texts):
            correct[start + position // samples] += is_correct(text, str(len(chunk[position // samples])))
            answers[text] = answers.get(text, 0) + 1
    model.train()
    n = samples * len(layouts)
    return {"accuracy": sum(correct) / n, "mixed_frac": sum(0 < c < samples for c in correct) / len(layouts),
            "most_common_answer_frac": max(answers.values()) / n}  # fmt: skip


def train(
    model: Any, shapes: Shapes, pool: list[Layout], eval_layouts: list[Layout], args: argparse.Namespace
) -> float:
    """AdamW SFT on noisy transcripts of layouts drawn from ``pool``, logging greedy accuracy on 100 eval layouts;
    returns the mean loss of the last log window."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed)
    model.train()
    start, running, last_loss = time.perf_counter(), 0.0, float("nan")
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        layouts = rng.choices(pool, k=args.batch_size)
        p_correct = 1.0 if step < args.clean_steps else args.p_correct
        answers = [noisy_count(len(layout), rng, p_correct) for layout in layouts]
        running += sft_step(model, optimizer, model(**shapes.transcripts(layouts, answers)).loss)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            window = step % args.log_every + 1
            greedy = evaluate(model, shapes, eval_layouts[:100], 1, greedy=True, seed=args.seed)["accuracy"]
            elapsed_s = time.perf_counter() - start
            print(f"step {step + 1:5d}  loss {running / window:.4f}  greedy@100 {greedy:.3f}  {elapsed_s:6.1f}s",
                  flush=True)  # fmt: skip
            last_loss, running = running / window, 0.0
    return last_loss


def main(argv: list[str] | None = None) -> None:
    """Write the splits and tiny_vlm's random checkpoint, pretrain it, evaluate, save it with a record."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    started = time.perf_counter()
    split_paths = write_splits(args.data_out or args.out.parent / "shapes", args.seed, args.n_train, args.n_eval)
    layouts = split_layouts(args.seed, args.n_pool, args.n_eval)
    save_tiny_vlm(args.out, args.seed)
    model = AutoModelForImageTextToText.from_pretrained(args.out, dtype=torch.float32)
    shapes = Shapes(model, AutoTokenizer.from_pretrained(args.out), AutoImageProcessor.from_pretrained(args.out))
    final_loss = train(model, shapes, layouts["train"], layouts["eval"], args)
    results = {
        "greedy": evaluate(model, shapes, layouts["eval"], 1, greedy=True, seed=args.seed),
        "temperature_1": evaluate(model, shapes, layouts["eval"], args.eval_samples, greedy=False, seed=args.seed),
    }
    print(json.dumps(results, indent=2))
    model.save_pretrained(args.out)
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "splits": {k: str(v) for k, v in split_paths.items()},
        "final_loss": final_loss,
        "eval": results,
        "image_blind_accuracy": 1 / MAX_COUNT,
        "wall_s": round(time.perf_counter() - started, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device_name": platform.processor() or "cpu",
    }
    (args.out / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
