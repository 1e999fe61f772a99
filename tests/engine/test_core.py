"""The engine in-process: rows batched together, preempted or aborted give what they would give alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import EOS_ID, VOCAB_SIZE, engines

from asyncrl.engine.core import Engine
from asyncrl.engine.rows import GenerationRequest, GenerationResult
from asyncrl.sampling import SamplingParams


@pytest.fixture
def make_engine(tiny_model):
    yield from engines(tiny_model, max_model_len=64, max_num_seqs=16, eos_token_id=EOS_ID)


def make_request(i: int, prompt_len: int, max_tokens: int, **settings) -> GenerationRequest:
    prompt = [(7 * i + 3 * j) % (VOCAB_SIZE - 3) + 3 for j in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, seed=100 + i, ignore_eos=True, **settings)
    return GenerationRequest(f"r{i}", prompt, params)


REQUESTS = [
    make_request(0, 3, 12),
    make_request(1, 9, 20, temperature=0.7, top_k=8),
    make_request(2, 15, 7, top_p=0.9),
    make_request(3, 5, 16, repetition_penalty=1.2),
    make_request(4, 12, 10, temperature=0.0),
    make_request(5, 1, 18, min_p=0.05, temperature=1.5),
]


def generate(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    futures = [engine.submit(request) for request in requests]
    return [future.result(timeout=60) for future in futures]


def assert_same_generations(actual: list[GenerationResult], expected: list[GenerationResult]) -> None:
    for mine, theirs in zip(actual, expected, strict=True):
        assert mine.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0)


def test_rows_decoded_together_match_rows_decoded_alone(make_engine):
    engine = make_engine()
    together = generate(engine, REQUESTS)
    alone = [generate(engine, [request])[0] for request in REQUESTS]
    assert_same_generations(together, alone)
    assert [len(r.token_ids) for r in together] == [r.params.max_tokens for r in REQUESTS]
    assert max(engine.stats().batch_sizes) > 1


def test_rows_joining_into_freed_cache_slots_match_rows_decoded_alone(make_engine):
    engine = make_engine(max_num_seqs=3)  # later requests take the slots of finished ones; the cache compacts
    requests = REQUESTS + [make_request(6 + i, 4 + 3 * i, 5 + 4 * i) for i in range(4)]
    together = generate(engine, requests)
    alone = [generate(engine, [request])[0] for request in requests]
    assert_same_generations(together, alone)
    assert max(engine.stats().batch_sizes) == 3


def test_a_group_sharing_one_prompt_is_prefilled_once_and_samples_as_if_alone(make_engine, tiny_model):
    engine = make_engine()
    group = [replace(make_request(0, 9, 10), request_id=f"g{k}") for k in range(6)]
    group = [replace(r, params=replace(r.params, seed=200 + k)) for k, r in enumerate(group)]
    requests = [*group[:3], make_request(1, 9, 8), *group[3:]]
    prefills: list[tuple[int, ...]] = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefills.append(tuple(kwargs["input_ids"].shape))

    engine.pause("keep", clear_cache=False)  # all seven join at the next step
    futures = [engine.submit(request) for request in requests]
    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        engine.resume()
        together = [future.result(timeout=60) for future in futures]
    finally:
        handle.remove()
    assert prefills == [(2, 9)]  # the group's prompt once, the other request's once
    assert_same_generations(together, [generate(engine, [request])[0] for request in requests])
    assert len({tuple(result.token_ids) for result in together}) == 7  # each row still samples with its own seed


def test_preempted_rows_are_recomputed_without_changing_their_tokens(make_engine):
    roomy = generate(make_engine(), REQUESTS)
    tight = make_engine(kv_cache_tokens=64)
    assert_same_generations(generate(tight, REQUESTS), roomy)
    stats = tight.stats()
    assert stats.preemptions_total > 0 and stats.running == 0 and stats.kv_tokens == 0


def test_abort_finishes_a_request_with_its_partial_output(make_engine):
    engine = make_engine()
    future = engine.submit(make_request(0, 4, 60))
    while engine.stats().generation_tokens_total == 0:
        pass
    engine.abort("r0")
    result = future.result(timeout=30)
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < 60
