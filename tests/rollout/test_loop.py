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
