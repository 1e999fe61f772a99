"""OpenAI's /v1/chat/completions on the built-in server (the tiny model `asyncrl serve` serves, whose tokenizer has a
chat template): open like /v1/completions, the messages through the chat template, then the completions path."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from tiny import build_tokenizer
from transformers import AutoTokenizer

from asyncrl.engine.chat import ChatCompletionRequest, as_completion_request
from asyncrl.prompts import render_prompt

MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 2 ="}]


def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=60)  # no token: generation needs none


def test_a_chat_completion_is_the_completion_of_its_templated_prompt(tiny_server, random_tiny_model_dir):
    sampling = {"max_tokens": 5, "temperature": 1.0, "seed": 7}
    chat = post(tiny_server.base_url, "/v1/chat/completions",
                {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, **sampling})  # fmt: skip
    assert chat.status_code == 200, chat.text
    prompt = render_prompt(AutoTokenizer.from_pretrained(random_tiny_model_dir), MESSAGES, {})
    plain = post(tiny_server.base_url, "/v1/completions", {"prompt": prompt, "logprobs": 2, **sampling}).json()
    answer, expected = chat.json(), plain["choices"][0]
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["model"] == plain["model"] and answer["usage"] == plain["usage"]
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected["text"], "refusal": None, "tool_calls": []}
    assert choice["finish_reason"] == expected["finish_reason"]
    content = choice["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == expected["logprobs"]["token_logprobs"]
    assert len(content) == answer["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_text_parts_are_joined_as_one_content(tiny_server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "1 + 2"}, {"type": "text", "text": "="}]}]
    joined = [{"role": "user", "content": "1 + 2\n="}]
    usage = [post(tiny_server.base_url, "/v1/chat/completions", {"messages": m, "max_tokens": 1}).json()["usage"]
             for m in (parts, joined)]  # fmt: skip
    assert usage[0] == usage[1]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"stream": True}, "does not support stream"),
        ({"tools": [{"type": "function", "function": {"name": "add"}}]}, "does not support tools"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "serves text only"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "the chat template refused them"),
        ({"messages": []}, "messages"),
    ],
    ids=repr,
)
def test_what_the_built_in_server_does_not_do_is_a_400(tiny_server, body, message):
    response = post(tiny_server.base_url, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_tokenizer_without_a_chat_template_points_to_completions():
    with pytest.raises(ValueError, match="no chat template: send a prompt to /v1/completions"):
        as_completion_request(ChatCompletionRequest(messages=MESSAGES), build_tokenizer(), 64)
