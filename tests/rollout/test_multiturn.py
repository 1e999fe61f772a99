"""The multi-turn tool loop with a scripted client: turns, tools, environment reward, samples and metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from transformers import AutoTokenizer

from asyncrl.assets.counter import build_counter_tokenizer
from asyncrl.config.schema import Config
from asyncrl.environments.counter import IncrementEnv
from asyncrl.rollout.environments import Agents
from asyncrl.rollout.group_metrics import group_metrics
from asyncrl.rollout.loop import AsyncRolloutLoop
from asyncrl.rollout.scoring import score_group


class ScriptedClient:
    """Answers each request with the next scripted text; records the prompts it saw."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []
        self.retry_count = 0

    async def sample(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), top_logprobs=None, sampling_masks=None,
                               finish_reason="stop")  # fmt: skip


def make_loop(replies: list[str], cap: int | None = None) -> tuple[AsyncRolloutLoop, ScriptedClient]:
    tokenizer = build_counter_tokenizer()
    config = Config()
    config.sampling.max_tool_calling_iterations = cap
    client = ScriptedClient(tokenizer, replies)
    return AsyncRolloutLoop(config, tokenizer, client, advantage_fn=None, max_model_len=256), client


async def episode(loop: AsyncRolloutLoop, target: int):
    agents = Agents([], {None: IncrementEnv}, None)
    ep = await agents.begin({"prompt": [{"role": "user", "content": f"Set the counter to {target}."}],
                             "target": target})  # fmt: skip
    rollout = await loop.generate_one(ep.prompt, ep.tools)
    rollout.env_reward, _ = await agents.end(ep)
    return rollout


def test_tool_loop_runs_calls_and_trains_every_generated_token_once():
    loop, client = make_loop(["<tool_call>increment(step=2)</tool_call>", "<tool_call>increment(step=1)</tool_call>"
                              "<tool_call>nope(x=1)</tool_call>", "\\boxed{3}"])  # fmt: skip
    rollout = asyncio.run(episode(loop, 3))
    assert len(rollout.turns) == 3 and rollout.env_reward == (IncrementEnv, 1.0)
    assert rollout.tool_call_count == 3 and rollout.tool_failure_count == 1
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant", "tool", "tool", "assistant"]
    assert rollout.completion[1]["content"] == "2" and "unknown tool" in rollout.completion[4]["content"]
    assert "tools: increment" in loop.tokenizer.decode(client.prompts[0])  # the environment's tool is exposed
    group = loop.build_group([], {}, [rollout, rollout], group_id=0, row_index=0,
                             model_version=0)  # fmt: skip
    (seq,) = group.completions_sequences[0]  # prefix-preserving template: one clean sample
    assert seq.num_trained == sum(len(t.output_ids) for t in rollout.turns)
    per_source = asyncio.run(score_group(group, []))
    assert list(per_source) == ["IncrementEnv"] and np.all(group.rewards == 1.0)
    metrics = group_metrics(group, per_source, drop=None)
    assert metrics["rollout/fork_frac"] == [0.0] * 4 and metrics["tools/call_frequency"] == [3.0, 3.0]
    assert metrics["tools/increment/call_count"] == [1.0] * 4 and metrics["tools/<unknown>/failure_count"] == [1.0] * 2
    assert metrics["tools/parallel_calls_mean"] == [1.0, 2.0, 1.0, 2.0]
    assert metrics["tools/unknown_name_count"] == [1.0, 1.0]


def test_iteration_cap_stops_a_rollout_still_calling_tools():
    loop, _ = make_loop(["<tool_call>increment(step=1)</tool_call>"] * 3, cap=2)
    rollout = asyncio.run(episode(loop, 5))
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2
    assert rollout.tool_stats.exhausted and rollout.env_reward == (IncrementEnv, 0.0)
    # admission's bound on a rollout before any group completes: the cap's turns and the answer, each a full context
    assert loop.max_rollout_tokens(with_tools=True) == len(rollout.turns) * loop.max_model_len


def test_a_rollouts_token_bound_is_unknown_without_a_cap_or_with_a_loops_own_turns():
    loop, _ = make_loop([])
    assert loop.max_rollout_tokens(with_tools=False) == 256 and loop.max_rollout_tokens(with_tools=True) is None

    class OwnTurns(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            return await super().generate_one(prompt, tools, group_id)

    assert OwnTurns(Config(), None, None, None, max_model_len=256).max_rollout_tokens(with_tools=False) is None


def test_a_single_turn_rollouts_bound_is_the_longest_prompt_and_the_completion_budget_inside_the_context():
    """The built-in server's context is its model's whole (32k+ for a real model): data.max_prompt_length bounds a
    single-turn rollout tighter, so the first step's groups start together there too."""
    loop, _ = make_loop([])
    loop.config.data.max_prompt_length, loop.config.sampling.max_completion_length = 40, 100
    assert loop.max_rollout_tokens(with_tools=False) == 140
    loop.config.data.max_prompt_length = 200  # past the context: the context bounds it
    assert loop.max_rollout_tokens(with_tools=False) == 256
    assert loop.max_rollout_tokens(with_tools=True) is None  # later turns carry the earlier ones: not bounded by it


def test_without_tools_the_loop_is_single_turn_and_logs_no_tool_metrics():
    loop, _ = make_loop(["<tool_call>increment(step=1)</tool_call>"])
    rollout = asyncio.run(loop.generate_one([{"role": "user", "content": "hi"}], []))
    assert len(rollout.turns) == 1 and rollout.tool_stats is None
    assert rollout.completion == [{"role": "assistant", "content": "<tool_call>increment(step=1)</tool_call>"}]


def test_calls_whose_markers_the_tokenizer_marks_special_still_run():
    """GLM-4.5's template with its call markers as special tokens: the loop's decoding keeps them, so the call is
    parsed (its integer argument typed by the tool's schema) and run, not erased with the other special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "asyncrl" / "assets" / "tiny-counter")
    markers = ["<|user|>", "<|assistant|>", "<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>",
               "</arg_key>", "<arg_value>", "</arg_value>"]  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "glm4_5.jinja").read_text()
    client = ScriptedClient(tokenizer, ["\n<think></think>\n<tool_call>increment\n<arg_key>step</arg_key>\n"
                                        "<arg_value>2</arg_value>\n</tool_call><|observation|>", "Done."])  # fmt: skip
    loop = AsyncRolloutLoop(Config(), tokenizer, client, advantage_fn=None, max_model_len=1024)
    assert loop.tool_call_format == "glm4"
    rollout = asyncio.run(episode(loop, 2))
    assert rollout.tool_call_count == 1 and rollout.tool_failure_count == 0
    assert rollout.env_reward == (IncrementEnv, 1.0) and rollout.completion[1]["content"] == "2"
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "increment", "arguments": {"step": 2}}
