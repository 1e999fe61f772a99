"""Message helpers shared by reward functions."""

from __future__ import annotations

from asyncrl.rewards.base import REWARDS, final_answer_text, message_text


def test_final_answer_text_reads_the_last_assistant_message():
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc"}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": r"\boxed{42}"},
        {"role": "tool", "content": "ignored"},
    ]
    assert final_answer_text(completion) == r"\boxed{42}"
    assert final_answer_text([{"role": "user", "content": "hi"}]) == ""


def test_message_text_joins_text_parts():
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": "b"}],
    }
    assert message_text(message) == "a b"
    assert message_text({"role": "assistant", "content": None}) == ""


def test_builtins_are_registered():
    assert {"accuracy", "format"} <= set(REWARDS.names())
