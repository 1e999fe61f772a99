"""OpenAI's ``POST /v1/chat/completions`` on the built-in server, so that OpenAI clients and evaluation tools talk
to a served run's model as they talk to vLLM.

The messages go through the model's chat template as a rollout's prompt does (``render_prompt``: the served model
sees the tokens it was trained on), and the request then takes /v1/completions' path: the same sampling fields,
validation, generation, stop strings and refusals (streaming is a 400 there, so here too), ``n`` completions
as choices. Tools are a 400 as well (their calls would come back as text, not parsed into ``tool_calls``) unless
``tool_choice`` is none, as vLLM renders them then and answers text. Image
content parts (``images.py``) reach a vision-language model's chat template and prefill; a text-only model refuses
them. With ``return_token_ids`` the response carries the prompt's and each choice's token ids, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from asyncrl.engine.images import NO_IMAGES, ImageInputs, ImagePrompts, split_images
from asyncrl.engine.protocol import (
    CompletionRequest,
    TokenTexts,
    completion_text,
    request_id,
    response_envelope,
    usage,
)
from asyncrl.engine.rows import GenerationResult
from asyncrl.prompts import render_prompt


class ChatCompletionRequest(BaseModel):
    """The chat fields the built-in server reads; the rest (model, max_tokens, temperature, seed, ...) are
    /v1/completions' and validated there."""

    model_config = ConfigDict(extra="allow", strict=True)

    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def as_completion_request(
    body: ChatCompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    image_prompts: ImagePrompts | None = None,
) -> tuple[CompletionRequest, ImageInputs | None]:
    """The conversation rendered by the chat template, as a /v1/completions request of token ids, and its images'
    inputs (None without images). Without a token limit it may fill the context, as OpenAI's and vLLM's chat
    routes do."""
    if body.tools and body.tool_choice != "none":
        raise ValueError("the built-in server does not support tools in chat completions (it does not parse tool "
                         "calls): send the conversation without them, or with tool_choice none (the template "
                         "renders them, the reply is text)")  # fmt: skip
    if body.top_logprobs is not None and not body.logprobs:
        raise ValueError("top_logprobs needs logprobs: true")
    if tokenizer.chat_template is None:
        raise ValueError("the served model's tokenizer has no chat template: send a prompt to /v1/completions")
    messages, image_parts = split_images(body.messages)
    if image_parts and image_prompts is None:
        raise ValueError(NO_IMAGES)
    try:
        prompt = render_prompt(tokenizer, messages, body.chat_template_kwargs or {}, body.tools)
    except TemplateError as error:
        raise ValueError(f"messages: the chat template refused them: {error}") from error
    images = None
    if image_parts:
        prompt, images = image_prompts.inputs(prompt, image_parts)
    fields = body.model_extra or {}
    limit = fields.get("max_tokens") if body.max_completion_tokens is None else body.max_completion_tokens
    completion = CompletionRequest.model_validate({
        **fields,
        "prompt": prompt,
        "max_tokens": max_model_len if limit is None else limit,  # capped to the context's room
        "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
    })  # fmt: skip
    return completion, images


def chat_completion_response(
    results: Sequence[GenerationResult], body: CompletionRequest, texts: TokenTexts, served_model_name: str
) -> dict[str, Any]:
    """OpenAI's ChatCompletion for a request's finished (or aborted) completions, with vLLM's ``stop_reason``."""
    model = body.model or served_model_name
    choices = [chat_choice(index, result, body, texts) for index, result in enumerate(results)]
    return {
        **response_envelope("chat.completion", f"chatcmpl-{request_id(results)}", model, choices),
        "usage": usage(results),
        "prompt_token_ids": results[0].prompt_ids if body.return_token_ids else None,
    }


def chat_choice(index: int, result: GenerationResult, body: CompletionRequest, texts: TokenTexts) -> dict[str, Any]:
    """One completion of a ChatCompletion, as an assistant message."""
    logprobs = None
    if body.logprobs is not None:
        tops = result.top_logprobs or [[] for _ in result.token_ids]
        as_ids = bool(body.return_tokens_as_token_ids)
        content = [
            {**_token(texts, token_id, logprob, as_ids), "top_logprobs": [_token(texts, c, v, as_ids) for c, v in top]}
            for token_id, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=True)
        ]
        logprobs = {"content": content, "refusal": None}
    message = {"role": "assistant", "content": completion_text(result, texts), "refusal": None, "tool_calls": []}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "token_ids": result.token_ids if body.return_token_ids else None,
    }


def _token(texts: TokenTexts, token_id: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    """A logprobs entry; ``as_ids`` (vLLM's return_tokens_as_token_ids): the token as "token_id:N"."""
    text = texts.texts[token_id]
    return {"token": f"token_id:{token_id}" if as_ids else text, "logprob": logprob, "bytes": list(text.encode())}
