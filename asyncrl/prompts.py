"""How a dataset's prompt becomes the tokens a server generates from, and a completion the text rewards see.

One module below rollout/, engine/, serving/, trainer/, plan/ and evaluate.py, which all render prompts: the rollouts,
the built-in server's chat route, the plan's sizing of vLLM's context, the server's context check and the held-out
evaluation must give the model the same tokens, from the same tokenizer (``load_tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

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


def load_tokenizer(config: Config) -> Any:
    """model.name_or_path's tokenizer; one that cannot be loaded (files missing from the directory or the cache) is a
    ConfigError naming the key, rather than transformers' traceback."""
    from transformers import AutoTokenizer

    from asyncrl.config.errors import ConfigError

    m = config.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code
        )
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"model.name_or_path={m.name_or_path}: cannot load its tokenizer ({first})") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_PROMPT_LENGTHS: dict[tuple[object, ...], int] = {}


RowTokens = Callable[[Any, dict[str, Any]], int]
"""``(tokenizer, row) -> the row's prompt length`` where rendering its prompt does not say it (its images)."""


def longest_prompt_tokens(config: Config, image_rows: Callable[[Config], RowTokens] | None = None) -> int:
    """data.max_prompt_length, else the longest chat-rendered prompt of the training data (cached per data+model: a
    sweep's jobs share it). The launcher measures it once for the run's plan (plan/assemble.py::sized).
    ``image_rows(config)``: how a row with images is measured, asked for when the data has images
    (rollout/images.py::image_prompt_tokens: each image as the server expands it)."""
    if config.data.max_prompt_length is not None:
        return config.data.max_prompt_length
    key = (
        config.data.path,
        config.data.name,
        config.data.split,
        config.model.name_or_path,
        json.dumps(config.sampling.chat_template_kwargs, sort_keys=True),
    )
    if key not in _PROMPT_LENGTHS:
        from asyncrl.data import has_images, load_train_prompts

        dataset = load_train_prompts(config)  # a stream (data.streaming) refuses to be measured, in one line
        tokenizer = load_tokenizer(config)
        kwargs = config.sampling.chat_template_kwargs
        if image_rows is not None and has_images(dataset):
            row_tokens = image_rows(config)
            _PROMPT_LENGTHS[key] = max(row_tokens(tokenizer, row) for row in dataset)  # type: ignore[union-attr]
        else:
            _PROMPT_LENGTHS[key] = max(len(render_prompt(tokenizer, p, kwargs)) for p in dataset["prompt"])  # type: ignore[index]
    return _PROMPT_LENGTHS[key]
