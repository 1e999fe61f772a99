"""AsyncRolloutLoop: the hooks a user subclasses to change generation, filtering or advantages.

The loop runs inside the spawned rollout worker (asyncrl/rollout/worker.py drives it). Subclass it at
module level, override only the hooks that change, and select it with
``rollout.loop_cls=my_pkg.module:MyLoop``; hooks can read ``self.config`` (``self.config.rollout.options``
holds free-form fields for the subclass) and ``self.tokenizer``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncrl.client import GenerationClient, SamplingParams
from asyncrl.config.schema import Config
from asyncrl.rollout.reconcile import reconcile
from asyncrl.rollout.types import Messages, Rollout, RolloutGroup, TurnRecord


def render_prompt(tokenizer: Any, messages: Messages, chat_template_kwargs: dict[str, Any]) -> list[int]:
    """Token ids of the conversation with the generation prompt appended (the model's chat template)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **chat_template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


class AsyncRolloutLoop:
    def __init__(
        self,
        config: Config,
        tokenizer: Any,
        client: GenerationClient,
        advantage_fn: Callable[[np.ndarray], np.ndarray],
        max_model_len: int,
        seed_offset: int = 0,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.advantage_fn = advantage_fn
        self.max_model_len = max_model_len
        self._seeds = itertools.count(config.trainer.seed * 1_000_003 + seed_offset)

    # ---- hooks -------------------------------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt; a rejected prompt still counts as consumed for the epoch."""
        return True

    async def generate_one(self, prompt: Messages, tools: list[Callable[..., Any]], group_id: int = 0) -> Rollout:
        """One rollout: render the conversation, sample one response (single turn)."""
        turn = await self.generate_one_turn(self.render(prompt))
        text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
        return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=turn.output_ids,
                       turns=[turn])  # fmt: skip

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One server request with every sampling setting sent explicitly and a unique seed."""
        s = self.config.sampling
        truncating = s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            max_tokens=max(1, min(s.max_completion_length, self.max_model_len - len(prompt_ids))),
            logprobs=s.num_sampler_logprobs,
            seed=next(self._seeds) % (2**31 - 1),
            return_sampling_mask=truncating,
        )
        out = await self.client.complete(prompt_ids, params)
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=list(out.token_ids),
            output_log_probs=list(out.logprobs),
            output_sampling_mask=out.sampling_masks if truncating else None,
            output_sampler_logprobs=out.top_logprobs if s.num_sampler_logprobs else None,
            finish_reason=out.finish_reason,
        )

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout from ``group.rewards`` (NaN = unscorable -> 0)."""
        assert group.rewards is not None
        return self.advantage_fn(group.rewards)

    async def setup(self) -> None:
        """Create resources the other hooks need; runs on the loop's event loop before the first prompt."""

    async def close(self) -> None:
        """Release what setup() created; runs when the loop stops, failure included."""

    # ---- helpers the driver uses ----------------------------------------------------------------------------

    def render(self, messages: Messages) -> list[int]:
        return render_prompt(self.tokenizer, messages, self.config.sampling.chat_template_kwargs)

    def build_group(
        self, prompt: Messages, row: dict[str, Any], rollouts: list[Rollout], *, group_id: int, row_index: int,
        model_version: int,
    ) -> RolloutGroup:  # fmt: skip
        n = len(rollouts)
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        return RolloutGroup(
            prompts=[prompt] * n,
            reward_kwargs=columns,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=[reconcile(r.turns) for r in rollouts],
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=model_version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=[None] * n,
            rollout_rewards=[r.reward for r in rollouts],
            rollouts=rollouts,
        )
