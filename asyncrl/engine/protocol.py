"""vLLM's /v1/completions request and response shapes, as far as the built-in server implements them.

Requests are validated strictly (a string where a number belongs is a 400, as in vLLM's pydantic models, and so
is an infinite or NaN sampling value);
unknown fields are accepted and ignored, as vLLM does. Features the built-in server does not implement
(streaming, echo, prompt logprobs, presence/frequency penalties) are a 400 rather than silently ignored; stop strings
end a completion as vLLM's do (rows.py::StopStrings). ``n > 1`` is n requests of seeds seed, seed + 1, ... (vLLM's
child requests), answered as n choices. Omitted sampling fields take neutral defaults (vLLM's
``--generation-config vllm``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from itertools import accumulate
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import PreTrainedTokenizerBase

from asyncrl.engine.images import ImageInputs
from asyncrl.engine.rows import GenerationRequest, GenerationResult, StopStrings
from asyncrl.sampling import SamplingParams

TokenId = Annotated[int, Field(ge=0)]


class ModelNotFound(LookupError):
    """The request names a model this server does not serve (HTTP 404, like vLLM)."""


class _Memo(dict[int, str]):
    """``make(key)`` for each key, computed once (indexing a dict subclass stays on the C fast path)."""

    def __init__(self, make: Callable[[int], str]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: int) -> str:
        value = self[key] = self._make(key)
        return value


class TokenTexts:
    """A tokenizer and its per-token strings, memoised (at most two per vocabulary id): a response with logprobs
    names every generated and top token, and one ``decode`` call per token cost more than the rest of the response.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.texts = _Memo(lambda token_id: tokenizer.decode([token_id]))
        self.id_labels = _Memo(lambda token_id: f"token_id:{token_id}")


MAX_N = 1024
"""Completions one request may ask for: each is a request of its own to the engine (``fan_out``), and a request of
millions must be a 400, not a queue that starves every other client."""


class CompletionRequest(BaseModel):
    """The fields of vLLM's CompletionRequest that the built-in server reads."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: Annotated[list[TokenId], Field(min_length=1)] | Annotated[str, Field(min_length=1)]
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    logprobs: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool | None = False
    echo: bool | None = False
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_sampling_mask: bool = False


def _check_supported(body: CompletionRequest) -> None:
    unsupported = {
        "stream": bool(body.stream),
        "echo": bool(body.echo),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "presence_penalty": bool(body.presence_penalty),
        "frequency_penalty": bool(body.frequency_penalty),
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(f"the built-in server does not support {', '.join(named)}")


def check_request_field(name: str, value: Any) -> None:
    """Raise ValueError saying why a request's field ``name`` set to ``value`` would not apply here: unknown fields
    are ignored (as vLLM ignores them), so a client adding fields to every request (sampling.generation_kwargs) asks
    before it sends any."""
    if name not in CompletionRequest.model_fields:
        known = ", ".join(CompletionRequest.model_fields)
        raise ValueError(f"not a field the built-in server reads (it reads: {known})")
    try:
        body = CompletionRequest.model_validate({"prompt": [0], name: value})
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from exc
    _check_supported(body)


def _prompt_ids(body: CompletionRequest, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
    prompt = list(body.prompt) if isinstance(body.prompt, list) else tokenizer(body.prompt).input_ids
    if not prompt:
        raise ValueError("prompt is empty after tokenisation")
    for field, ids in (("prompt", prompt), ("stop_token_ids", body.stop_token_ids or [])):
        unknown = [token for token in ids if token >= vocab_size]
        if unknown:
            raise ValueError(f"{field} contains token ids outside the vocabulary (size {vocab_size}): {unknown[:8]}")
    return prompt


def _sampling_params(body: CompletionRequest, max_tokens: int) -> SamplingParams:
    """The validated body as the one sampling type. Omitted fields take vLLM's neutral defaults; top_k -1 and 0
    both mean no top-k."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=0 if body.top_k is None else max(body.top_k, 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=0.0 if body.min_p is None else body.min_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        logprobs=body.logprobs,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        return_sampling_mask=body.return_sampling_mask,
    )


def build_generation_request(
    body: CompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    *,
    served_model_name: str,
    max_model_len: int,
    max_logprobs: int,
    vocab_size: int,
    adapters: Collection[str] = (),
    images: ImageInputs | None = None,
) -> GenerationRequest:
    """Validate a request against this server and turn it into the engine's request (with its prompt's ``images``);
    a ``model`` naming a loaded LoRA adapter runs under it."""
    if body.model is not None and body.model != served_model_name and body.model not in adapters:
        raise ModelNotFound(f"The model `{body.model}` does not exist.")
    _check_supported(body)
    prompt = _prompt_ids(body, tokenizer, vocab_size)
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{len(prompt)} input tokens, which leaves no room for completion tokens."
        )
    if body.logprobs is not None and 0 <= max_logprobs < body.logprobs:
        raise ValueError(
            f"Requested sample logprobs of {body.logprobs}, which is greater than max allowed: {max_logprobs}"
        )
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if body.min_tokens > max_tokens:
        raise ValueError(f"min_tokens={body.min_tokens} must be at most max_tokens={max_tokens}")
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_ids=prompt,
        params=_sampling_params(body, max_tokens=min(max_tokens, max_model_len - len(prompt))),
        adapter=body.model if body.model in adapters else None,
        images=images,
        stop=stop_strings(body.stop, tokenizer),
    )


def stop_strings(stop: str | list[str] | None, tokenizer: PreTrainedTokenizerBase) -> StopStrings | None:
    """A request's ``stop`` (one string or a list; empty strings match nothing) for the engine, decoded as the
    completion's text is (special tokens skipped)."""
    strings = tuple(s for s in ([stop] if isinstance(stop, str) else stop or []) if s)
    if not strings:
        return None
    return StopStrings(strings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def fan_out(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """A request of ``n`` completions as n requests, as vLLM splits one into child requests: child i draws from seed
    + i (an unseeded request's children each draw their own)."""
    if n == 1:
        return [request]
    seed = request.params.seed
    return [replace(request, request_id=f"{index}_{request.request_id}",
                    params=replace(request.params, seed=None if seed is None else seed + index))
            for index in range(n)]  # fmt: skip


def completion_response(
    results: Sequence[GenerationResult], body: CompletionRequest, texts: TokenTexts, served_model_name: str
) -> dict[str, Any]:
    """vLLM's CompletionResponse for a request's finished (or aborted) completions, one choice each."""
    choices = [completion_choice(index, result, body, texts) for index, result in enumerate(results)]
    return {
        **response_envelope(
            "text_completion", f"cmpl-{request_id(results)}", body.model or served_model_name, choices
        ),  # fmt: skip
        "usage": usage(results),
        "kv_transfer_params": None,  # vLLM: disaggregated prefill's hand-over; none here
        "metrics": None,
    }


def completion_choice(index: int, result: GenerationResult, body: CompletionRequest,
                      texts: TokenTexts) -> dict[str, Any]:  # fmt: skip
    """One completion of a CompletionResponse."""
    logprobs = None
    if body.logprobs is not None:
        logprobs = _logprobs(result, texts, as_ids=bool(body.return_tokens_as_token_ids))
    choice: dict[str, Any] = {
        "index": index,
        "text": completion_text(result, texts),
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "token_ids": result.token_ids if body.return_token_ids else None,
        "prompt_token_ids": result.prompt_ids if body.return_token_ids else None,
        "prompt_logprobs": None,
        "routed_experts": None,  # vLLM: a MoE's expert choices when asked (--enable-return-routed-experts)
    }
    if body.return_sampling_mask:
        choice["sampling_masks"] = result.sampling_masks
    return choice


def response_envelope(kind: str, response_id: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields every OpenAI-style response shares around its choices (completions and chat)."""
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
    }


def completion_text(result: GenerationResult, texts: TokenTexts) -> str:
    """The generated text, without the stop token that ended it, or cut where the stop string that ended it starts
    (vLLM's text without include_stop_str_in_output)."""
    if isinstance(result.stop_reason, str):
        text = texts.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        at = text.rfind(result.stop_reason)
        return text if at < 0 else text[:at]
    text_ids = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
    return texts.tokenizer.decode(text_ids, skip_special_tokens=True)


def request_id(results: Sequence[GenerationResult]) -> str:
    """The id of the request ``results`` answer: the one request's, or the parent's of fanned-out children."""
    return results[0].request_id if len(results) == 1 else results[0].request_id.partition("_")[2]


def usage(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """The response's token counts (OpenAI's usage object): the prompt once, every completion's tokens."""
    prompt_tokens, completion_tokens = len(results[0].prompt_ids), sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None,
    }


def _logprobs(result: GenerationResult, texts: TokenTexts, *, as_ids: bool) -> dict[str, Any]:
    """vLLM's legacy logprobs object; each top_logprobs dict starts with the sampled token."""
    labels = texts.id_labels if as_ids else texts.texts
    strings = [texts.texts[token_id] for token_id in result.token_ids]
    tops = result.top_logprobs or [[] for _ in result.token_ids]
    top_logprobs = []
    for token_id, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=True):
        entry = {labels[token_id]: logprob}
        for candidate, value in top:
            entry.setdefault(labels[candidate], value)
        top_logprobs.append(entry)
    return {
        "text_offset": [0, *accumulate(len(text) for text in strings)][: len(strings)],
        "token_logprobs": result.logprobs,
        "tokens": [labels[token_id] for token_id in result.token_ids],
        "top_logprobs": top_logprobs,
    }
