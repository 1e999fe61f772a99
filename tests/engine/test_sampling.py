"""Per-row sampling against a plain float64 reference: processors, candidate sets, top logprobs, draws."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from tiny import VOCAB_SIZE

from asyncrl.engine.sampling import RowInput, process_logits, sample_step
from asyncrl.sampling import SamplingParams

ROWS = [
    (SamplingParams(), set(), ()),
    (SamplingParams(temperature=0.7, top_k=5), set(), ()),
    (SamplingParams(top_p=0.8), set(), ()),
    (SamplingParams(temperature=1.3, top_k=10, top_p=0.9), set(), ()),
    (SamplingParams(temperature=0.5, min_p=0.1), set(), ()),
    (SamplingParams(repetition_penalty=1.3), {3, 7, 11, 40}, ()),
    (SamplingParams(temperature=0.0, top_k=3), set(), ()),
    (SamplingParams(top_k=4), set(), (1, 2)),
]


def reference_processed(logits: torch.Tensor, settings: SamplingParams, seen: set[int], suppressed) -> torch.Tensor:
    """One row, float64, written as loops: suppression, penalty, temperature, min-p, top-k, top-p."""
    x = logits.double().clone()
    x[list(suppressed)] = float("-inf")
    for token in seen:
        penalty = settings.repetition_penalty
        x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
    x = x / (settings.temperature or 1.0)
    if settings.min_p > 0:
        probs = x.softmax(-1)
        x[probs < settings.min_p * probs.max()] = float("-inf")
    if settings.top_k > 0:
        x[x < x.sort(descending=True).values[settings.top_k - 1]] = float("-inf")
    if settings.top_p < 1:
        probs, kept, mass = x.softmax(-1), [], 0.0
        for token in x.argsort(descending=True).tolist():
            if mass >= settings.top_p:
                break
            kept.append(token)
            mass += probs[token].item()
        dropped = torch.ones_like(x, dtype=torch.bool)
        dropped[kept] = False
        x[dropped] = float("-inf")
    return x


def row_inputs(rows=ROWS, seed: int = 0) -> list[RowInput]:
    inputs = []
    for i, (settings, seen, suppressed) in enumerate(rows):
        mask = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
        mask[list(seen)] = True
        inputs.append(RowInput(settings, random.Random(seed + i).random(), mask, suppressed))
    return inputs


def test_processed_logprobs_match_a_float64_reference_for_every_processor():
    logits = torch.randn(len(ROWS), VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 3
    processed = process_logits(logits, row_inputs()).log_softmax(-1)
    for i, (settings, seen, suppressed) in enumerate(ROWS):
        expected = reference_processed(logits[i], settings, seen, suppressed).log_softmax(-1)
        assert torch.equal(torch.isfinite(processed[i]), torch.isfinite(expected)), settings
        finite = torch.isfinite(expected)
        torch.testing.assert_close(processed[i][finite].double(), expected[finite], atol=1e-5, rtol=0)
    assert torch.isfinite(processed[0]).all()  # no processor: the whole vocabulary stays a candidate


def test_sample_step_reports_candidates_top_logprobs_and_greedy_argmax():
    rows = [(replace(s, logprobs=4, return_sampling_mask=True), seen, sup) for s, seen, sup in ROWS]
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(1)) * 3
    draws = sample_step(logits, row_inputs(rows))
    processed = process_logits(logits, row_inputs(rows)).log_softmax(-1)
    for i, ((settings, _, _), draw) in enumerate(zip(rows, draws, strict=True)):
        assert draw.logprob == pytest.approx(processed[i, draw.token_id].item(), abs=1e-6)
        candidates = torch.isfinite(processed[i]).nonzero().flatten().tolist()
        assert draw.candidate_ids == (candidates if settings.truncates else None)
        assert draw.token_id in candidates
        top_values = [value for _, value in draw.top_logprobs]
        assert len(draw.top_logprobs) == 4 and top_values == sorted(top_values, reverse=True)
        assert draw.top_logprobs[0][0] == processed[i].argmax().item()
    assert draws[6].token_id == logits[6].argmax().item()  # greedy row


def test_draws_follow_the_processed_distribution_and_seeds_repeat():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB_SIZE - 4)]).repeat(4000, 1)
    rows = [(SamplingParams(temperature=0.8), set(), ())] * 4000
    tokens = torch.tensor([draw.token_id for draw in sample_step(logits, row_inputs(rows))])
    frequencies = torch.bincount(tokens, minlength=VOCAB_SIZE)[:4].double() / 4000
    torch.testing.assert_close(frequencies, (logits[0, :4].double() / 0.8).softmax(-1), atol=0.03, rtol=0)
    again = [draw.token_id for draw in sample_step(logits[:50], row_inputs(rows[:50]))]
    assert again == tokens[:50].tolist()


def test_the_extreme_uniforms_draw_the_first_and_last_candidates_never_a_removed_token():
    logits = torch.full((2, VOCAB_SIZE), float("-inf"))
    logits[:, 3:6] = torch.tensor([0.5, -1.0, 2.0])  # candidates 3, 4, 5; the rest removed (e.g. by top-k)
    rows = [RowInput(SamplingParams(), uniform, None) for uniform in (0.0, 1 - 2**-53)]
    assert [draw.token_id for draw in sample_step(logits, rows)] == [3, 5]
