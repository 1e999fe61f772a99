"""Tools the model calls during a rollout: schemas, parsing the model's calls, running them off the event loop.

Formats: ``hermes`` (Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks), ``llama3``
(the whole reply is ``{"name": ..., "parameters": {...}}``, several joined by ``;``, optionally after
``<|python_tag|>``) and ``tiny`` (``<tool_call>name(key=json, ...)</tool_call>``, short enough for the
character-level embedded model). Failures never raise: they become tool messages and are counted.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from asyncrl.rollout.types import Messages

FORMATS = ("hermes", "llama3", "tiny")
TINY_MARKER = "tool-call format: tiny"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TINY_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.DOTALL)


@dataclass
class ToolCall:
    """One call the model emitted; ``error`` is set when it could not be parsed (then it fails as a tool result)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


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


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template speaks; ``hermes`` unless it is Llama 3's or the tiny model's."""
    template = chat_template or ""
    if TINY_MARKER in template:
        return "tiny"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3"
    return "hermes"


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(the text without the well-formed calls, the calls in emitted order) for format ``fmt``."""
    if fmt == "llama3":
        return _parse_llama3(text)
    if fmt not in ("hermes", "tiny"):
        raise ValueError(f"rollout.tool_call_format={fmt!r}: expected one of {FORMATS} or auto")
    parse_block = _parse_hermes_block if fmt == "hermes" else _parse_tiny_block
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        call = parse_block(match.group(1))
        calls.append(call)
        return match.group(0) if call.error else ""

    content = _BLOCK.sub(take, text)
    return content.strip(), calls


def _parse_hermes_block(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"tool call is not valid JSON ({exc.msg})")
    return _from_mapping(data, "arguments")


def _parse_tiny_block(body: str) -> ToolCall:
    match = _TINY_CALL.match(body)
    if match is None:
        return ToolCall("", {}, "tool call is not of the form name(key=value, ...)")
    try:
        node = ast.parse(f"f({match.group(2)})", mode="eval").body
        assert isinstance(node, ast.Call)
        if node.args:
            raise ValueError("positional arguments are not allowed")
        arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except (SyntaxError, ValueError) as exc:
        return ToolCall(match.group(1), {}, f"bad arguments for {match.group(1)}: {exc}")
    return ToolCall(match.group(1), arguments)


def _literal(node: ast.expr) -> Any:
    """A JSON literal: Python literals plus true/false/null."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    return ast.literal_eval(node)


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text.strip(), []
    calls = []
    for part in (p for p in body.split(";") if p.strip()):
        try:
            calls.append(_from_mapping(json.loads(part), "parameters"))
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"tool call is not valid JSON ({exc.msg})"))
    return "", calls


def _from_mapping(data: Any, key: str) -> ToolCall:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", {}, 'tool call needs a string "name"')
    arguments = data.get(key, data.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(data["name"], {}, f"arguments of {data['name']} are not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], {}, f"arguments of {data['name']} are not an object")
    return ToolCall(data["name"], arguments)


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
) -> tuple[str, bool]:
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
    return result if isinstance(result, str) else json.dumps(result, default=str), False


def template_preserves_prefix(tokenizer: Any, chat_template_kwargs: dict[str, Any]) -> bool:
    """Whether rendering a conversation after a tool round starts with the tokens of the turn that called it."""
    call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
    before = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    after = [*before, {"role": "tool", "name": "probe", "content": "1"}]
    try:
        held = tokenizer.apply_chat_template(before, tokenize=False, **chat_template_kwargs)
        full = tokenizer.apply_chat_template(after, tokenize=False, add_generation_prompt=True, **chat_template_kwargs)
    except Exception:
        return False
    return full.startswith(held.rstrip())
