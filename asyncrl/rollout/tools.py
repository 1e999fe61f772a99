"""Tools the model calls during a rollout: schemas, running the calls off the event loop, the prefix check.

Reading the calls out of a completion is rollout/tool_formats.py's (one parser per model family); its names are
re-exported here. Failures never raise: they become tool messages and are counted.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from asyncrl.rollout.tool_formats import FORMATS as FORMATS
from asyncrl.rollout.tool_formats import TINY_MARKER as TINY_MARKER
from asyncrl.rollout.tool_formats import ToolCall
from asyncrl.rollout.tool_formats import decode_turn as decode_turn
from asyncrl.rollout.tool_formats import detect_format as detect_format
from asyncrl.rollout.tool_formats import parse_tool_calls as parse_tool_calls
from asyncrl.rollout.types import Messages


@dataclass
class ToolStats:
    """What one rollout's tool calls did, for the ``tools/*`` metrics."""

    calls: list[tuple[str, float, bool]] = field(default_factory=list)
    """(tool name, latency in seconds, failed) per call, in execution order; a name that is no tool's is
    ``<unknown>`` (one metric key for every misspelling the model emits), a call without one ``<malformed>``."""
    unknown_names: int = 0
    parallel: list[int] = field(default_factory=list)
    """Calls per assistant message that called tools."""
    exhausted: bool = False
    """Cut off at max_tool_calling_iterations while still calling tools."""

    @property
    def failures(self) -> int:
        return sum(failed for _, _, failed in self.calls)


def tool_name(fn: Callable[..., Any]) -> str:
    """The name the model calls a tool by: its ``__name__`` (bound methods included)."""
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise TypeError(f"tool {fn!r} has no usable __name__: tools must be named module-level functions or methods")
    return name


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """JSON schemas from type hints and Google-style docstrings (transformers' chat-template tool support)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant turn as a chat message: well-formed calls as ``tool_calls``; malformed ones stay in content."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    good = [c for c in calls if c.error is None]
    if good:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in good]  # fmt: skip
    return message


async def run_tool_calls(
    calls: list[ToolCall], tools: dict[str, Callable[..., Any]], pool: Executor | None, stats: ToolStats
) -> Messages:
    """Run the calls one after another in emitted order; sync tools on ``pool``, never on the event loop."""
    stats.parallel.append(len(calls))
    results = []
    for call in calls:
        started = time.monotonic()
        content, failed = await _run_one(call, tools, pool, stats)
        name = call.name if call.name in tools else "<unknown>" if call.name else "<malformed>"
        stats.calls.append((name, time.monotonic() - started, failed))
        results.append({"role": "tool", "name": call.name, "content": content})
    return results


async def _run_one(
    call: ToolCall, tools: dict[str, Callable[..., Any]], pool: Executor | None, stats: ToolStats
) -> tuple[str | list[dict[str, Any]], bool]:
    if call.error is not None:
        return f"Error: {call.error}", True
    fn = tools.get(call.name)
    if fn is None:
        stats.unknown_names += 1
        return f"Error: unknown tool {call.name!r}; available: {sorted(tools)}", True
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return f"Error: bad arguments for {call.name}: {exc}", True
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(**call.arguments)
        else:
            result = await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, **call.arguments))
    except Exception as exc:
        return f"Error: {call.name} raised {type(exc).__name__}: {exc}", True
    if isinstance(result, str):
        return result, False
    if not has_image_block(result):
        return json.dumps(result, default=str), False
    try:
        return content_blocks(result), False
    except (ValueError, OSError) as exc:  # a block that is neither an image nor a text, or an unreadable image
        return f"Error: {call.name} returned {exc}", True


def has_image_block(result: Any) -> bool:
    """A tool result given as a list of content blocks with an image among them (TRL's multimodal tool responses)."""
    return isinstance(result, list) and any(isinstance(b, dict) and b.get("type") == "image" for b in result)


def content_blocks(result: list[Any]) -> list[dict[str, Any]]:
    """A multimodal tool result as a message's content parts: each image decoded (rollout/images.py), text as it
    is; the model's next turn sees them (its server renders the images)."""
    from asyncrl.rollout.images import decode_image

    parts = []
    for block in result:
        if not (isinstance(block, dict) and block.get("type") in ("image", "text")):
            raise ValueError(f"a tool result's content block {str(block)[:60]!r}: give {{'type': 'image', 'image': "
                             "...} or {'type': 'text', 'text': ...}")  # fmt: skip
        image = block.get("image")
        parts.append({"type": "image", "image": decode_image(image)} if block["type"] == "image" else dict(block))
    return parts


def render_tool_round(tokenizer: Any, chat_template_kwargs: dict[str, Any]) -> tuple[str, str]:
    """(a user turn and a tool-calling turn, the same plus the tool's result and the next generation prompt) as the
    chat template renders them; raises whatever the template raises."""
    call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
    before = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    after = [*before, {"role": "tool", "name": "probe", "content": "1"}]
    held = tokenizer.apply_chat_template(before, tokenize=False, **chat_template_kwargs)
    full = tokenizer.apply_chat_template(after, tokenize=False, add_generation_prompt=True, **chat_template_kwargs)
    return held, full


def template_preserves_prefix(tokenizer: Any, chat_template_kwargs: dict[str, Any]) -> bool:
    """Whether rendering a conversation after a tool round starts with the tokens of the turn that called it."""
    try:
        held, full = render_tool_round(tokenizer, chat_template_kwargs)
    except Exception:
        return False
    return full.startswith(held.rstrip())
