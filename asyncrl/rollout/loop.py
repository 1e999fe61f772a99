"""AsyncRolloutLoop: the hooks a user subclasses to change generation, filtering or advantages.

The loop runs inside the spawned rollout worker (asyncrl/rollout/worker.py drives it). Subclass it at
module level, override only the hooks that change, and select it with
``rollout.loop_cls=my_pkg.module:MyLoop``; hooks can read ``self.config`` (``self.config.rollout.options``
holds free-form fields for the subclass) and ``self.tokenizer``.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

import numpy as np

from asyncrl.advantages import Estimator, estimate_advantages
from asyncrl.client import GenerationClient, SamplingParams
from asyncrl.config.schema import Config
from asyncrl.prompts import Messages, completion_of, render_prompt
from asyncrl.rollout.images import ImageProcessing, image_processing, prompt_images, request_messages, template_messages
from asyncrl.rollout.reconcile import reconcile
from asyncrl.rollout.tools import (
    ToolStats,
    assistant_message,
    decode_turn,
    detect_format,
    parse_tool_calls,
    run_tool_calls,
    tool_name,  # fmt: skip
    tool_schemas,
)
from asyncrl.rollout.types import PromptImages, Rollout, RolloutGroup, TurnRecord

RENDERED_PROMPTS = 256
"""Prompts whose tokens ``render`` keeps: more than the groups a worker has in flight start at once."""


class PromptTooLong(ValueError):
    """A prompt longer than data.max_prompt_length, or leaving no room in the server's context: the worker skips
    its group and counts it (rollout/skipped_long_prompt_count)."""


class AsyncRolloutLoop:
    def __init__(
        self,
        config: Config,
        tokenizer: Any,
        client: GenerationClient,
        advantage_fn: Estimator,
        max_model_len: int,
        seed_offset: int = 0,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.advantage_fn = advantage_fn
        self.max_model_len = max_model_len
        self._seeds = itertools.count(config.trainer.seed * 1_000_003 + seed_offset)
        self.tool_pool: Executor | None = None
        """Where sync tools run (the worker sets a pool of max_concurrent_rollouts threads); None = asyncio's."""

    # ---- hooks -------------------------------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt; a rejected prompt still counts as consumed for the epoch."""
        return True

    async def generate_one(self, prompt: Messages | str, tools: list[Callable[..., Any]], group_id: int = 0) -> Rollout:
        """One rollout, the tool loop: render the whole conversation, sample a turn, run the tools it calls,
        append their results, repeat until a turn calls none (or the iteration cap or the context is hit). A
        standard (plain-text) prompt gets one turn, its completion the text (no tools: trainer/setup.py checks). A
        conversation with images (its prompt's, or a tool result's) turns through the server's chat route."""
        if isinstance(prompt, str):
            return await self.complete_text(prompt)
        by_name = {tool_name(fn): fn for fn in tools}
        schemas = tool_schemas(tools) if tools else None
        cap = self.config.sampling.max_tool_calling_iterations
        messages, completion, turns = list(prompt), [], []
        stats = ToolStats() if tools else None
        prompt_ids, images = self.render_conversation(messages, schemas)
        self.check_prompt_length(prompt_ids)
        while True:
            if images is None:
                turn = await self.generate_one_turn(prompt_ids)
            else:
                turn = await self.generate_image_turn(messages, schemas, prompt_ids, images)
            turns.append(turn)
            text = decode_turn(self.tokenizer, turn.output_ids, self.tool_call_format if tools else None)
            content, calls = parse_tool_calls(text, self.tool_call_format, schemas) if tools else (text, [])
            completion.append(assistant_message(content, calls) if calls else {"role": "assistant", "content": text})
            if stats is None or not calls or turn.finish_reason != "stop":
                break
            if cap is not None and len(stats.parallel) >= cap:
                stats.exhausted = True
                break
            completion.extend(await run_tool_calls(calls, by_name, self.tool_pool, stats))
            messages = [*prompt, *completion]
            prompt_ids, images = self.render_conversation(messages, schemas)
            if len(prompt_ids) >= self.max_model_len:
                break  # no room left for another turn: the rollout ends on the tool results
        return Rollout(
            completion=completion, completion_ids=[t for turn in turns for t in turn.output_ids], turns=turns,
            tool_call_count=len(stats.calls) if stats else 0, tool_failure_count=stats.failures if stats else 0,
            tool_stats=stats,
        )  # fmt: skip

    async def complete_text(self, prompt: str) -> Rollout:
        """One turn after a plain-text prompt: the completion is the decoded text, as TRL's for a standard dataset."""
        prompt_ids = self.render(prompt)
        self.check_prompt_length(prompt_ids)
        turn = await self.generate_one_turn(prompt_ids)
        text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
        return Rollout(completion=completion_of(prompt, text), completion_ids=list(turn.output_ids), turns=[turn])

    def render_conversation(
        self, messages: Messages, tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], tuple[list[str], PromptImages] | None]:
        """The conversation's prompt tokens, and for one with images (rollout/images.py) the tokens as the server
        expands them and the images as a request sends them (data URLs) and the trainer takes them (patches)."""
        images = prompt_images(messages)
        if not images:
            return self.render(messages, tools), None
        urls, patches = self.image_processing.prepare(images)
        return patches.expand(self.render(template_messages(messages), tools)), (urls, patches)

    async def generate_image_turn(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None,
        prompt_ids: list[int],
        images: tuple[list[str], PromptImages],
    ) -> TurnRecord:
        """One turn of a conversation with images, which the server renders: its prompt tokens are the server's,
        checked against the patches the trainer gets."""
        urls, patches = images
        out = await self.client.chat(request_messages(messages, urls), self.sampling_params(prompt_ids), tools)
        if out.finish_reason != "abort":
            self.image_processing.check(out.prompt_token_ids, patches)
        return TurnRecord(
            prompt_ids=out.prompt_token_ids or prompt_ids,
            output_ids=list(out.token_ids),
            output_log_probs=list(out.logprobs or []),
            output_sampler_logprobs=out.top_logprobs if self.config.sampling.num_sampler_logprobs else None,
            finish_reason=out.finish_reason,
            images=patches,
        )

    @functools.cached_property
    def image_processing(self) -> ImageProcessing:
        """The checkpoint's image processor, loaded at the first prompt with images."""
        return image_processing(self.config)

    def check_prompt_length(self, prompt_ids: list[int]) -> None:
        """Raise PromptTooLong for a prompt over data.max_prompt_length, or without room in the server's context
        for one generated token (the server would refuse the request)."""
        limit = self.config.data.max_prompt_length
        if limit is not None and len(prompt_ids) > limit:
            raise PromptTooLong(f"a prompt of {len(prompt_ids)} tokens > data.max_prompt_length={limit}")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLong(f"a prompt of {len(prompt_ids)} tokens leaves no room in the server's context "
                                f"({self.max_model_len} tokens, server.max_model_len)")  # fmt: skip

    def sampling_params(self, prompt_ids: list[int]) -> SamplingParams:
        """Every sampling setting of one turn, sent explicitly, with a unique seed (override to vary per turn)."""
        s = self.config.sampling
        return SamplingParams.of(
            s,
            max_tokens=max(1, min(s.max_completion_length, self.max_model_len - len(prompt_ids))),
            logprobs=s.num_sampler_logprobs,
            seed=next(self._seeds) % (2**31 - 1),
            return_sampling_mask=s.truncates,
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One server request; candidate sets come back when the sampler truncated (top-k/top-p/min-p)."""
        params = self.sampling_params(prompt_ids)
        truncating = params.return_sampling_mask
        s = self.config.sampling
        out = await self.client.sample(prompt_ids, params)
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=list(out.token_ids),
            output_log_probs=list(out.logprobs),
            output_sampling_mask=out.sampling_masks if truncating else None,
            output_sampler_logprobs=out.top_logprobs if s.num_sampler_logprobs else None,
            finish_reason=out.finish_reason,
        )

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout from ``group.rewards`` (NaN = unscorable -> 0); estimators that normalise
        each reward function (gdpo) also get ``group.reward_components``."""
        assert group.rewards is not None
        return estimate_advantages(self.advantage_fn, group.rewards, group.reward_components)

    def max_rollout_tokens(self, with_tools: bool) -> int | None:
        """The most tokens one rollout can hold, as admission counts them (every turn's prompt and output, a turn at
        most the server's ``max_model_len``; one turn at most data.max_prompt_length and the completion budget, which
        bounds it on the built-in server, whose context is its model's whole): with it the first groups start
        together before any has completed (rollout/admission.py). None where unknown: groups then start one at a
        time until the first completes. A subclass whose ``generate_one`` takes turns its own way gets None unless it
        overrides this too."""
        if type(self).generate_one is not AsyncRolloutLoop.generate_one:
            return None
        if not with_tools:
            longest = self.config.data.max_prompt_length
            turn = self.max_model_len if longest is None else longest + self.config.sampling.max_completion_length
            return min(self.max_model_len, turn)
        cap = self.config.sampling.max_tool_calling_iterations
        return None if cap is None else (cap + 1) * self.max_model_len  # cap turns call tools, one more answers

    async def setup(self) -> None:
        """Create resources the other hooks need; runs on the loop's event loop before the first prompt."""

    async def close(self) -> None:
        """Release what setup() created; runs when the loop stops, failure included."""

    # ---- helpers the driver uses ----------------------------------------------------------------------------

    def render(self, messages: Messages | str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's prompt tokens. A group's rollouts render the same first turn one after another, so a
        conversation without tools is rendered once for all of them (``_rendered``): the chat template was an eighth
        of the worker's CPU a rollout (benchmarks/RESULTS.md, worker CPU)."""
        if tools:
            return render_prompt(self.tokenizer, messages, self.config.sampling.chat_template_kwargs, tools)
        if isinstance(messages, str):
            return list(self._rendered(messages, False))
        try:
            text = json.dumps(messages)
        except TypeError:  # content that is not plain data: rendered as it is, every time
            return render_prompt(self.tokenizer, messages, self.config.sampling.chat_template_kwargs, None)
        return list(self._rendered(text, True))

    @functools.cached_property
    def _rendered(self) -> Callable[[str, bool], tuple[int, ...]]:
        """``render`` of a prompt without tools, by its text (``as_json``: a message list as JSON), for the last
        RENDERED_PROMPTS prompts."""

        @functools.lru_cache(maxsize=RENDERED_PROMPTS)
        def rendered(prompt: str, as_json: bool) -> tuple[int, ...]:
            messages = json.loads(prompt) if as_json else prompt
            return tuple(render_prompt(self.tokenizer, messages, self.config.sampling.chat_template_kwargs, None))

        return rendered

    @functools.cached_property
    def tool_call_format(self) -> str:
        """rollout.tool_call_format, or the format the chat template speaks when it is auto."""
        fmt = self.config.rollout.tool_call_format
        return detect_format(getattr(self.tokenizer, "chat_template", None)) if fmt == "auto" else fmt

    def build_group(
        self, prompt: Messages | str, row: dict[str, Any], rollouts: list[Rollout], *, group_id: int, row_index: int,
        model_version: int,
    ) -> RolloutGroup:  # fmt: skip
        n = len(rollouts)
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        return RolloutGroup(
            prompts=[prompt] * n,
            reward_kwargs=columns,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=[[replace(s, truncated=r.truncated) for s in reconcile(r.turns)] for r in rollouts],
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=model_version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=[r.env_reward for r in rollouts],
            rollout_rewards=[r.reward for r in rollouts],
            rollouts=rollouts,
        )
