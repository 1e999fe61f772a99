"""The rollout loop's hooks: each turn's request carries every sampling setting of the run."""

from __future__ import annotations

from asyncrl.config.compose import compose, to_config
from asyncrl.rollout.loop import AsyncRolloutLoop
from asyncrl.sampling import SamplingParams

SETTINGS = ["sampling.top_k=5", "sampling.num_sampler_logprobs=3", "sampling.max_completion_length=8",
            "sampling.structured_outputs_regex=ab", "+sampling.generation_kwargs.stop=[END]"]  # fmt: skip


def test_a_turns_request_carries_the_runs_structured_outputs_and_generation_kwargs():
    config = to_config(compose(SETTINGS))
    loop = AsyncRolloutLoop(config, tokenizer=None, client=None, advantage_fn=None, max_model_len=12)
    params = loop.sampling_params(prompt_ids=[1, 2, 3, 4, 5, 6])
    assert params == SamplingParams(temperature=config.sampling.temperature, top_k=5, structured_outputs_regex="ab",
                                    generation_kwargs={"stop": ["END"]}, max_tokens=6, logprobs=3, seed=params.seed,
                                    return_sampling_mask=True)  # fmt: skip


def test_a_prompt_without_tools_is_rendered_once_for_its_group(monkeypatch):
    """A group's rollouts render the same first turn: the chat template runs once for them; with tools, every time."""
    from asyncrl.assets.tiny_model import build_tokenizer
    from asyncrl.rollout import loop as loop_module

    calls = []
    render = loop_module.render_prompt

    def counted(tokenizer, messages, kwargs, tools):
        calls.append(tools)
        return render(tokenizer, messages, kwargs, tools)

    monkeypatch.setattr(loop_module, "render_prompt", counted)
    loop = AsyncRolloutLoop(to_config(compose([])), build_tokenizer(), client=None, advantage_fn=None, max_model_len=64)
    conversation = [{"role": "user", "content": "1 + 2 ="}]
    ids = [loop.render([dict(m) for m in conversation]) for _ in range(8)]  # each rollout's own copy, as Agents makes
    assert ids == [render(loop.tokenizer, conversation, {}, None)] * 8 and len(calls) == 1
    assert loop.render("1 + 2 =") == render(loop.tokenizer, "1 + 2 =", {}, None) and len(calls) == 2
    ids[0].append(99)  # a caller's list is its own
    assert loop.render(conversation) != ids[0]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    loop.render(conversation, tools)
    loop.render(conversation, tools)
    assert len(calls) == 4
