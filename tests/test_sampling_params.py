"""One sampling type from config to server: a run's knobs carry into each request, whose own fields win."""

from __future__ import annotations

from asyncrl.config.compose import compose, to_config
from asyncrl.sampling import SamplingParams


def test_a_request_takes_the_configs_knobs_and_its_own_fields():
    config = to_config(compose(["sampling.temperature=0.7", "sampling.top_k=5", "sampling.structured_outputs_regex=ab",
                                "+sampling.generation_kwargs.stop=[END]"]))  # fmt: skip
    params = SamplingParams.of(config.sampling, temperature=0.0, max_tokens=9, seed=3)
    assert params == SamplingParams(temperature=0.0, top_k=5, structured_outputs_regex="ab",
                                    generation_kwargs={"stop": ["END"]}, max_tokens=9, seed=3)  # fmt: skip
    assert params.greedy and params.truncates and config.sampling.truncates and not config.sampling.greedy


def test_only_top_k_top_p_or_min_p_truncate_the_candidate_set():
    assert not SamplingParams(temperature=0.5, repetition_penalty=1.3).truncates
    assert all(SamplingParams(**knob).truncates for knob in ({"top_k": 1}, {"top_p": 0.9}, {"min_p": 0.1}))
