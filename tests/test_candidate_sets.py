"""Top-k/top-p/min-p candidate sets: the trainer's renormalisation against a float64 reference and against the
sampler's own processed logprobs, and the once-only warning when a server cannot return the sets."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from transformers import AutoModelForCausalLM

from asyncrl.client import Completion, GenerationClient, SamplingParams
from asyncrl.serving.command import served_name
from asyncrl.trainer.token_logprobs import compute_token_logprobs


def reference_logprobs(logits: np.ndarray, sets: list[list[int] | None], targets: list[int]) -> np.ndarray:
    """log p(target) under softmax restricted to each slot's set, in float64."""
    out = []
    for row, candidates, target in zip(logits.astype(np.float64), sets, targets, strict=True):
        support = np.arange(row.size) if candidates is None else np.asarray(candidates)
        out.append(row[target] - np.log(np.exp(row[support] - row.max()).sum()) - row.max())
    return np.asarray(out)


def trainer_logprobs(logits: torch.Tensor, sets: list[list[int] | None], targets: list[int]) -> torch.Tensor:
    """The trainer's renormalised log-probabilities of raw logits (through an identity LM head, 5 slots a chunk)."""
    head = torch.nn.Linear(logits.shape[1], logits.shape[1], bias=False)
    head.weight.data = torch.eye(logits.shape[1])
    return compute_token_logprobs(logits, head, torch.tensor(targets), 1.0, sampling_masks=sets,
                                  chunk_tokens=5).logprobs.detach()  # fmt: skip


def test_renormalisation_over_candidate_sets_matches_float64():
    rng = np.random.default_rng(0)
    vocab, slots = 200, 12
    logits = rng.normal(0, 4, size=(slots, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, size=slots).tolist()
    sets: list[list[int] | None] = []
    for slot, target in enumerate(targets):
        if slot % 4 == 3:
            sets.append(None)  # no set recorded: the whole vocabulary
            continue
        others = rng.choice(np.setdiff1d(np.arange(vocab), [target]), size=rng.integers(0, 40), replace=False)
        sets.append(sorted([target, *others.tolist()]))
    ours = trainer_logprobs(torch.from_numpy(logits), sets, targets).double().numpy()
    np.testing.assert_allclose(ours, reference_logprobs(logits, sets, targets), rtol=0, atol=1e-5)
    full = torch.log_softmax(torch.from_numpy(logits), -1).gather(1, torch.tensor(targets)[:, None]).squeeze(1)
    restricted_slots = [i for i, s in enumerate(sets) if s is not None]
    assert (ours[restricted_slots] > full.numpy()[restricted_slots]).all()  # full-vocabulary ratios are biased


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def test_sets_from_the_generate_endpoint_reproduce_the_samplers_logprobs(server, random_tiny_model_dir):
    prompt = [4, 30, 31, 32, 5]
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_tokens=16, logprobs=3, seed=11,
                            return_sampling_mask=True)  # fmt: skip

    async def sample() -> tuple[Completion, bool | None]:
        async with GenerationClient(server.base_url, served_name(str(random_tiny_model_dir)), timeout_s=60) as client:
            return await client.sample(prompt, params), client.candidate_sets

    out, capable = asyncio.run(sample())
    assert capable is True and out.sampling_masks is not None and len(out.sampling_masks) == len(out.token_ids)
    assert all(token in mask and len(mask) <= 12 for token, mask in zip(out.token_ids, out.sampling_masks, strict=True))
    assert all(next(iter(top)) == token for token, top in zip(out.token_ids, out.top_logprobs or [], strict=True))
    model = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float() / 0.8
    trainer = trainer_logprobs(logits, out.sampling_masks, out.token_ids)
    np.testing.assert_allclose(trainer.numpy(), out.logprobs, atol=1e-4)
    np.testing.assert_allclose(out.logprobs, reference_logprobs(logits.numpy(), out.sampling_masks, out.token_ids),
                               atol=1e-4)  # fmt: skip


def stub_app(bodies: list[tuple[str, dict[str, Any]]], generate: dict[str, Any] | None) -> FastAPI:
    app = FastAPI()
    choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": [7], "prompt_token_ids": [1],
              "logprobs": {"token_logprobs": [-0.5], "top_logprobs": [{"token_id:7": -0.5}]}}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        bodies.append(("completions", await request.json()))
        return {"choices": [choice]}

    if generate is not None:

        @app.post("/inference/v1/generate")
        async def inference(request: Request) -> dict[str, Any]:
            bodies.append(("generate", await request.json()))
            return generate

    return app


@pytest.mark.parametrize("generate", [None, {"choices": [{"token_ids": [7], "finish_reason": "length"}]}],
                         ids=["no endpoint", "no mask"])  # fmt: skip
def test_a_server_without_sets_is_warned_about_once(generate, caplog, serve_app):
    bodies: list[tuple[str, dict[str, Any]]] = []
    params = SamplingParams(top_k=5, max_tokens=1, return_sampling_mask=True)

    async def two_turns(url: str) -> list[Completion]:
        async with GenerationClient(url, "m", timeout_s=10) as client:
            return [await client.sample([1], params), await client.sample([1], params)]

    with serve_app(stub_app(bodies, generate)) as url, caplog.at_level(logging.WARNING, logger="asyncrl.client"):
        outs = asyncio.run(two_turns(url))
    assert [o.token_ids for o in outs] == [[7], [7]] and all(o.sampling_masks is None for o in outs)
    expected = ["completions"] * 2 if generate is None else ["generate", "completions", "completions"]
    assert [kind for kind, _ in bodies] == expected
    assert all("return_sampling_mask" not in body for kind, body in bodies if kind == "completions")
    warnings = [r for r in caplog.records if "cannot return per-token candidate sets" in r.getMessage()]
    assert len(warnings) == 1 and "biased" in warnings[0].getMessage()


def test_generate_choices_parse_both_logprob_formats():
    tops = [{"token_id": 7, "logprob": -0.5}, {"token_id": 9, "logprob": -1.0}]
    content = [
        {"token_id": 7, "logprob": -0.5, "top_logprobs": tops},  # vLLM >= 0.32
        {"token": "token_id:8", "logprob": -0.1, "top_logprobs": [{"token": "token_id:8", "logprob": -0.1}]},
    ]
    choice = {"token_ids": [7, 8], "finish_reason": "stop", "sampling_mask": [[7, 9], [8]],
              "logprobs": {"content": content}}  # fmt: skip
    out = Completion.from_generate_choice(choice, [1, 2])
    assert out == Completion(token_ids=[7, 8], logprobs=[-0.5, -0.1], top_logprobs=[{7: -0.5, 9: -1.0}, {8: -0.1}],
                             sampling_masks=[[7, 9], [8]], finish_reason="stop", prompt_token_ids=[1, 2])  # fmt: skip
