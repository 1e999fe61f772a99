"""vLLM's tokens-in/tokens-out ``POST /inference/v1/generate`` on the built-in server, with the sampling mask.

vLLM returns each generated token's candidate set only from this endpoint (``--return-sampling-mask``,
``choices[].sampling_mask``), so the built-in server answers it too and the rollout worker has one code
path for both servers. The built-in server behaves as if started with ``--return-sampling-mask``: a request
that truncates its distribution (top-k, top-p, min-p) gets the mask. Responses use vLLM >= 0.32's shape
(integer ``token_id`` in logprobs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.engine.protocol import CompletionRequest, TokenId, request_id
from asyncrl.engine.rows import GenerationResult


class GenerateRequest(BaseModel):
    """The fields of vLLM's GenerateRequest the built-in server reads; ``sampling_params`` as in completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool = False


def as_completion_request(body: GenerateRequest) -> CompletionRequest:
    """The same request in /v1/completions form, so both endpoints share validation and sampling."""
    fields = {
        **body.sampling_params,
        "prompt": body.token_ids,
        "model": body.model,
        "stream": body.stream,
        "return_sampling_mask": True,
    }
    return CompletionRequest.model_validate(fields)


def generate_response(
    results: Sequence[GenerationResult], body: CompletionRequest, served_model_name: str
) -> dict[str, Any]:
    """vLLM's GenerateResponse (``output_mode`` tokens) for a request's completions, one choice each."""
    prompt_tokens, completion_tokens = len(results[0].prompt_ids), sum(len(r.token_ids) for r in results)
    return {
        "request_id": request_id(results),
        "output_mode": "tokens",
        "model": body.model or served_model_name,
        "created": int(time.time()),
        "choices": [generate_choice(index, result, body) for index, result in enumerate(results)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def generate_choice(index: int, result: GenerationResult, body: CompletionRequest) -> dict[str, Any]:
    logprobs = None
    if body.logprobs is not None:
        tops = result.top_logprobs or [[] for _ in result.token_ids]
        content = [
            _token_entry(token_id, logprob, top)
            for token_id, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=True)
        ]
        logprobs = {"content": content}
    return {
        "index": index,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "logprobs": logprobs,
        "sampling_mask": result.sampling_masks,
    }


def _token_entry(token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    """The sampled token, then the top candidates by rank without repeating it (vLLM's order)."""
    ranks = {candidate: rank for rank, (candidate, _) in enumerate(top, start=1)}
    tops = [{"token_id": token_id, "logprob": logprob, "rank": ranks.get(token_id)}]
    tops += [{"token_id": c, "logprob": v, "rank": ranks[c]} for c, v in top if c != token_id]
    return {"token_id": token_id, "logprob": logprob, "rank": ranks.get(token_id), "top_logprobs": tops}
