"""How a dataset's prompt becomes the tokens a server generates from, and a completion the text rewards see.

One module below rollout/, engine/, serving/ and evaluate.py, which all render prompts: the rollouts, the built-in
server's chat route, the server's context check and the held-out evaluation must give the model the same tokens.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]
"""A conversation: chat messages, each a dict with ``role`` and ``content`` (and tool fields)."""


def render_prompt(
    tokenizer: Any, messages: Messages | str, chat_template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:  # fmt: skip
    """Token ids of the conversation with the generation prompt appended (the model's chat template); a standard
    (plain-text) prompt as TRL's GRPOTrainer tokenizes it: no template, with the special tokens the tokenizer adds
    (a base Llama's or Gemma's BOS, without which a Gemma 3 base model only repeats the prompt's last line)."""
    if isinstance(messages, str):
        return list(tokenizer(messages)["input_ids"])
    if tools:
        chat_template_kwargs = {**chat_template_kwargs, "tools": tools}
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **chat_template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def completion_of(prompt: Messages | str, text: str) -> Messages | str:
    """A one-turn completion as the reward functions get it: the text after a plain-text prompt, an assistant
    message after a conversation."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
