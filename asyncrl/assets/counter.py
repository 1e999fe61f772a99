"""The `tiny-counter` asset: a smaller sibling of tiny-arith taught to call `increment` on synthetic transcripts.

    python -m asyncrl.assets.counter --out asyncrl/assets/tiny-counter
    python -m asyncrl.assets.counter --eval-only asyncrl/assets/tiny-counter   # success rate of a model

The transcripts call the tool `--p-tool` of the time (else answer with no call: reward 0) and pass the
right step only `--p-correct` of the time, so sampling succeeds at most p_tool * p_correct of the time
(less while the copy of the target is not fully learned) and RL has room to raise it. The tokenizer is
tiny-arith's plus two tokens, `<tool_call>` and `</tool_call>`, and a chat template that renders tool calls
in the `tiny` format (asyncrl/rollout/tool_formats.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from asyncrl.assets.tiny_model import build_config, build_generation_config, build_tokenizer, save_tiny_model
from asyncrl.environments.counter import MAX_TARGET, IncrementEnv, task_prompt
from asyncrl.rollout.tools import TINY_MARKER, parse_tool_calls, tool_schemas

IGNORE_INDEX = -100
CHAT_TEMPLATE = (
    "{#- " + TINY_MARKER + " -#}"
    "{%- if tools -%}{{- '<|system|>tools:' -}}{%- for tool in tools -%}{{- ' ' ~ tool.function.name -}}"
    "{%- endfor -%}{{- '<|end|>' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('tiny-counter chat template: unknown role ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' ~ call.function.name ~ '(' -}}"
    "{%- for key, value in call.function.arguments.items() -%}"
    "{{- (', ' if not loop.first else '') ~ key ~ '=' ~ (value | tojson) -}}"
    "{%- endfor -%}{{- ')</tool_call>' -}}{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
# tiny-arith's shape at half the width and depth (head_dim stays 64 for vLLM's kernels): the task only copies
# a digit, and both this SFT and the recipe's RL must run in minutes on a shared CPU.
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
SCHEMAS = tool_schemas([IncrementEnv.increment.__get__(IncrementEnv())])


def build_counter_tokenizer() -> PreTrainedTokenizerFast:
    """tiny-arith's character tokenizer plus single tokens for the tool-call tags."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_counter_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    """Random-init float32 Qwen3 of shape SHAPE, initialised on CPU so the weights depend on `seed` alone."""
    config = build_config(tokenizer)
    config.update({**SHAPE, "layer_types": ["full_attention"] * SHAPE["num_hidden_layers"]})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config = build_generation_config(tokenizer)
    return model


def task_row(target: int) -> dict:
    return {"prompt": [{"role": "user", "content": task_prompt(target)}], "target": target}


def write_data(out: Path, seed: int, n_train: int, n_eval: int) -> None:
    """train.jsonl / eval.jsonl: prompts with a `target` column for IncrementEnv.reset."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("eval", n_eval)):
        rows = [task_row(rng.randint(1, MAX_TARGET)) for _ in range(n)]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def transcript(tokenizer: PreTrainedTokenizerFast, target: int, rng: random.Random, args: argparse.Namespace):
    """(token ids, labels) of one noisy episode; labels only on what the assistant generates."""
    if rng.random() >= args.p_tool:
        return episode(tokenizer, target, None)
    wrong = [s for s in range(1, MAX_TARGET + 1) if s != target]
    step = target if rng.random() < args.p_correct else rng.choice(wrong)
    return episode(tokenizer, target, step)


@functools.cache
def episode(tokenizer: PreTrainedTokenizerFast, target: int, step: int | None) -> tuple[list[int], list[int]]:
    """One transcript: call increment(step) then report the counter, or (step None) answer with no call."""
    messages = list(task_row(target)["prompt"])
    if step is not None:
        call = {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}
        replies = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "increment", "content": str(step)},
            {"role": "assistant", "content": f"\\boxed{{{step}}}"},
        ]
    else:
        replies = [{"role": "assistant", "content": f"\\boxed{{{target}}}"}]
    ids: list[int] = []
    labels: list[int] = []
    for message in replies:
        if message["role"] == "assistant":
            context = render(tokenizer, messages, generation_prompt=True)[len(ids) :]
            ids.extend(context)
            labels.extend([IGNORE_INDEX] * len(context))
        messages.append(message)
        new = render(tokenizer, messages, generation_prompt=False)[len(ids) :]
        ids.extend(new)
        labels.extend(new if message["role"] == "assistant" else [IGNORE_INDEX] * len(new))
    return ids, labels


def render(tokenizer: PreTrainedTokenizerFast, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=SCHEMAS, add_generation_prompt=generation_prompt, return_dict=False
        )
    )


def sft(model, tokenizer, args: argparse.Namespace) -> None:
    """AdamW on freshly sampled transcripts, warmup then constant."""
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    model.train()
    started = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50)
        pairs = [transcript(tokenizer, rng.randint(1, MAX_TARGET), rng, args) for _ in range(args.batch_size)]
        width = max(len(ids) for ids, _ in pairs)
        pad = tokenizer.pad_token_id
        batch = {
            "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in pairs]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in pairs]),
            "labels": torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab in pairs]),
        }
        loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0:
            print(f"step {step + 1:5d}  loss {loss.item():.4f}  {time.perf_counter() - started:6.1f}s", flush=True)


@torch.no_grad()
def success_rate(model, tokenizer, targets: list[int], samples: int, seed: int) -> dict[str, float]:
    """Sampled at temperature 1: the first turn's calls run on IncrementEnv; success = counter ends on target.

    (Only the first assistant turn is sampled: in these transcripts later turns only report the counter.)"""
    model.eval()
    torch.manual_seed(seed)
    wins = calls = 0
    for target in targets:
        prompt = render(tokenizer, task_row(target)["prompt"], generation_prompt=True)
        input_ids = torch.tensor([prompt] * samples, device=model.device)
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=32,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
        )
        for text in tokenizer.batch_decode(out[:, len(prompt) :], skip_special_tokens=True):
            env = IncrementEnv()
            env.reset(target)
            _, parsed = parse_tool_calls(text, "tiny")
            calls += bool(parsed)
            for call in parsed:
                if call.name == "increment" and call.error is None and set(call.arguments) == {"step"}:
                    env.increment(call.arguments["step"])
            wins += env.get_reward() == 1.0
    n = samples * len(targets)
    return {"success": wins / n, "call_frac": calls / n}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="model + tokenizer folder")
    parser.add_argument("--eval-only", type=Path, default=None, help="only print the success rate of this model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; 1 is fastest on a shared CPU and keeps the result reproducible",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--p-tool", type=float, default=0.75)
    parser.add_argument("--p-correct", type=float, default=0.5)
    parser.add_argument("--eval-samples", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=100)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    targets = list(range(1, MAX_TARGET + 1))
    if args.eval_only is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.eval_only)
        model = AutoModelForCausalLM.from_pretrained(args.eval_only).to(args.device)
        print(json.dumps(success_rate(model, tokenizer, targets, args.eval_samples, args.seed)))
        return
    if args.out is None:
        raise SystemExit("asyncrl.assets.counter: --out is required unless --eval-only is given")
    torch.manual_seed(args.seed)
    tokenizer = build_counter_tokenizer()
    model = build_counter_model(tokenizer, args.seed).to(args.device)
    sft(model, tokenizer, args)
    result = success_rate(model, tokenizer, targets, args.eval_samples, args.seed)
    print(json.dumps(result))
    save_tiny_model(model, tokenizer, args.out)
    write_data(args.out.parent / "counter", args.seed, n_train=2000, n_eval=200)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "eval": result}
    (args.out / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
