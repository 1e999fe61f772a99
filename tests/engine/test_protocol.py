"""/v1/completions responses built from an engine result: vLLM's legacy logprobs object, token names memoised; and
which extra request fields the server would apply."""

from __future__ import annotations

import pytest
from tiny import build_tokenizer

from asyncrl.engine.protocol import CompletionRequest, TokenTexts, check_request_field, completion_response
from asyncrl.engine.rows import GenerationResult

TOKENS = [40, 7, 40, 12]
RESULT = GenerationResult(
    request_id="r",
    prompt_ids=[5, 9],
    token_ids=TOKENS,
    logprobs=[-0.5, -1.0, -0.25, -2.0],
    top_logprobs=[[(7, -0.1), (40, -0.5)], [(7, -1.0)], [(40, -0.25), (3, -3.0)], [(12, -2.0), (40, -2.5)]],
    sampling_masks=None,
    finish_reason="length",
    stop_reason=None,
)


def test_logprobs_name_tokens_by_text_or_id_and_start_with_the_sampled_one():
    tokenizer = build_tokenizer()
    texts = TokenTexts(tokenizer)
    for as_ids in (False, True, False):  # the second text response is served from the memo
        body = CompletionRequest(prompt=[5, 9], logprobs=2, return_tokens_as_token_ids=as_ids)
        logprobs = completion_response([RESULT], body, texts, "tiny")["choices"][0]["logprobs"]
        name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: tokenizer.decode([t]))
        assert logprobs["tokens"] == [name(t) for t in TOKENS]
        lengths = [len(tokenizer.decode([t])) for t in TOKENS]
        assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(TOKENS))]
        assert logprobs["top_logprobs"][0] == {name(40): -0.5, name(7): -0.1}
        assert list(logprobs["top_logprobs"][2]) == [name(40), name(3)]
    assert set(texts.texts) == {3, 7, 12, 40} and set(texts.id_labels) == {3, 7, 12, 40}


def test_an_extra_request_field_is_refused_unless_the_server_reads_and_applies_it():
    check_request_field("presence_penalty", 0.0)  # read, and neutral
    check_request_field("stop", ["x"])  # stop strings apply
    for name, value, why in (
        ("stopp", ["x"], "stopp: not a field the built-in server reads (it reads: prompt, model, max_tokens,"),
        ("presence_penalty", "high", "presence_penalty: Input should be a valid number"),
    ):
        with pytest.raises(ValueError) as info:
            check_request_field(name, value)
        assert f"{name}: {info.value}".startswith(why)
