"""Held-out evaluation through the generation server: the reward functions on the eval split.

Runs before training (the server holds the initial weights, or a resumed run's checkpoint), at
logging.eval_steps and checkpoint steps if asked (trainer/loop.py), and after the last weight sync, greedy and
sampled at the training temperature (pass@1), so a run ends with a before/after comparison. The two answer
different questions: sampled is a completion drawn as in training (sampling.num_generations_eval of them per
prompt, averaged), the pass@1 GRPO raises; greedy is the completion the model finds most likely, which moves only
when that answer changes (a model that already answers right greedily stays at its ceiling while sampled climbs to
it). Greedy is top-1 sampling at temperature 1: a vLLM >= 0.28 that returns sampling masks (--return-sampling-mask,
which asyncrl passes when top-k/top-p/min-p are on) refuses every request with temperature 0 or top_k 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.client import GenerationClient
from asyncrl.config.schema import Config
from asyncrl.prompts import completion_of, render_prompt
from asyncrl.rollout.images import (
    ImageProcessing,
    data_folder,
    image_processing,
    place_row_images,
    prompt_images,
    request_messages,
    template_messages,
)
from asyncrl.rollout.scoring import RewardSource, score_group
from asyncrl.rollout.types import RolloutGroup
from asyncrl.sampling import SamplingParams

Progress = Callable[[str, int, int], None]
"""Told after each completion: (the pass, greedy or sampled; completions done; completions in all)."""


def _no_progress(label: str, done: int, total: int) -> None:
    pass


@dataclass(frozen=True)
class EvalPrompt:
    """A held-out prompt as the server gets it: its tokens, or for a prompt with images its chat messages (the
    server renders those; ``ids`` is then the expected rendering, for the completion's budget)."""

    ids: list[int]
    messages: list[dict[str, Any]] | None = None


def eval_prompts(config: Config, tokenizer: Any, rows: list[dict[str, Any]]) -> list[EvalPrompt]:
    """Each row's prompt as the server gets it; rows with images as chat messages (rollout/images.py)."""
    s = config.sampling
    processing: ImageProcessing | None = None
    prompts = []
    for row in rows:
        images = prompt_images(row["prompt"])
        if not images:
            prompts.append(EvalPrompt(render_prompt(tokenizer, row["prompt"], s.chat_template_kwargs)))
            continue
        processing = processing or image_processing(config)
        urls, patches = processing.prepare(images)
        rendered = render_prompt(tokenizer, template_messages(row["prompt"]), s.chat_template_kwargs)
        prompts.append(EvalPrompt(patches.expand(rendered), request_messages(row["prompt"], urls)))
    return prompts


async def _complete_all(
    client: GenerationClient,
    prompts: list[EvalPrompt],
    params: list[SamplingParams],
    concurrency: int,
    done: Callable[[int], None] = lambda finished: None,
) -> list[Any]:
    """Every prompt's completion, ``concurrency`` at a time; ``done`` gets the count as each comes back."""
    gate = asyncio.Semaphore(concurrency)
    finished = 0

    async def one(prompt: EvalPrompt, p: SamplingParams) -> Any:
        nonlocal finished
        async with gate:
            out = await (client.complete(prompt.ids, p) if prompt.messages is None else client.chat(prompt.messages, p))
        finished += 1
        done(finished)
        return out

    return await asyncio.gather(*(one(i, p) for i, p in zip(prompts, params, strict=True)))


async def _evaluate(
    config: Config,
    base_urls: str | list[str],
    model_name: str,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    sources: list[RewardSource],
    max_model_len: int,
    progress: Progress,
) -> dict[str, float]:
    s = config.sampling
    prompts = eval_prompts(config, tokenizer, rows)
    results: dict[str, float] = {}
    async with GenerationClient(base_urls, model_name, timeout_s=config.server.timeout) as client:
        # greedy as top-1 sampling: vLLM >= 0.28 started with --return-sampling-mask refuses temperature 0
        passes = (("greedy", 1.0, 1, 1), ("sampled", s.temperature, s.top_k, s.num_generations_eval))
        for label, temperature, top_k, copies in passes:
            asked = [prompt for prompt in prompts for _ in range(copies)]  # each prompt's copies side by side
            total = len(asked)
            params = [
                SamplingParams.of(
                    s,
                    temperature=temperature,
                    top_k=top_k,
                    logprobs=None,
                    seed=config.trainer.seed + i,
                    max_tokens=max(1, min(s.max_completion_length, max_model_len - len(prompt.ids))),
                )
                for i, prompt in enumerate(asked)
            ]
            concurrency = config.server.max_num_seqs * len(client.servers)  # each server's batch
            outs = await _complete_all(client, asked, params, concurrency=concurrency,
                                       done=lambda n, label=label, total=total: progress(label, n, total))  # fmt: skip
            copied = [row for row in rows for _ in range(copies)]
            results[f"eval/{label}_reward"] = await _mean_reward(copied, outs, tokenizer, sources)
    return results


async def _mean_reward(
    rows: list[dict[str, Any]], outs: list[Any], tokenizer: Any, sources: list[RewardSource]
) -> float:
    group = RolloutGroup(
        prompts=[r["prompt"] for r in rows],
        reward_kwargs={k: [r[k] for r in rows] for k in rows[0] if k != "prompt"},
        completions=[
            completion_of(r["prompt"], tokenizer.decode(o.token_ids, skip_special_tokens=True))
            for r, o in zip(rows, outs, strict=True)
        ],
        completions_ids=[list(o.token_ids) for o in outs],
        completions_sequences=[[] for _ in rows],
        tool_call_counts=[0] * len(rows),
        tool_failure_counts=[0] * len(rows),
        model_version=0,
        group_id=-1,
        row_index=-1,
        env_rewards=[None] * len(rows),
        rollout_rewards=[None] * len(rows),
    )
    await score_group(group, sources)
    assert group.rewards is not None
    return float(np.nanmean(group.rewards)) if np.isfinite(group.rewards).any() else float("nan")


def evaluate(
    config: Config,
    base_urls: str | list[str],
    model_name: str,
    tokenizer: Any,
    dataset: Any,
    sources: list[RewardSource],
    max_model_len: int,
    progress: Progress = _no_progress,
) -> dict[str, float]:
    """Mean reward of greedy and sampled completions on the first ``data.num_eval_prompts`` eval rows, spread over
    the servers at ``base_urls``; ``progress`` is told as the completions come back (the console shows it)."""
    folder = data_folder(config.data.eval_path) if config.data.eval_path is not None else None
    rows = [place_row_images(dataset[i], folder) for i in range(min(len(dataset), config.data.num_eval_prompts))]
    return asyncio.run(_evaluate(config, base_urls, model_name, tokenizer, rows, sources, max_model_len, progress))


@dataclass
class EvalRecord:
    """A run's evaluations at its two ends (eval.json and the console's closing line): the model it started from
    (the base model, or the checkpoint a resumed run starts from, whatever the weights were called) and the
    model it ended with, each at its optimizer step."""

    before: dict[str, float]
    before_step: int
    resumed: bool = False
    after: dict[str, float] = field(default_factory=dict)
    after_step: int = 0

    @property
    def origin(self) -> str:
        return f"checkpoint step {self.before_step}" if self.resumed else "base model"

    def to_json(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after, "before_model": self.origin,
                "before_step": self.before_step, "after_step": self.after_step}  # fmt: skip

    def summary(self, num_prompts: int, temperature: float) -> str:
        """One line: what each score means, then where it started and ended."""
        moved = "; ".join(
            f"{label} {self.before[key]:.3f} -> {self.after[key]:.3f}"
            for label, key in (("sampled", "eval/sampled_reward"), ("greedy", "eval/greedy_reward"))
        )
        return (
            f"held-out reward on {num_prompts} prompts, {self.origin} -> step {self.after_step}: {moved} (sampled: "
            f"one completion at temperature {temperature:g}, the pass@1 training raises; greedy: the most likely "
            "completion, which moves only when the model's preferred answer changes)"
        )
