"""How each model family writes a tool call in its completion, and how the rollout loop reads it back.

Each format is one parser, picked from the chat template (``detect_format``) or by ``rollout.tool_call_format``.
rollout/tools.py runs the calls. A call that cannot be read comes back with ``error`` set; it then fails as a
tool result and is counted. Parsing never raises.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

TINY_MARKER = "tool-call format: tiny"


@dataclass
class ToolCall:
    """One call the model emitted; ``error`` is set when it could not be parsed (then it fails as a tool result)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


StringParams = Mapping[str, frozenset[str]]
"""Tool name -> the parameters its schema types as strings. GLM-4 writes those values unquoted, so only the schema
tells the string "3" from the number 3."""

Parser = Callable[[str, StringParams], tuple[str, list[ToolCall]]]


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax."""

    name: str
    parse: Parser
    """(text without the well-formed calls, the calls in emitted order)."""
    markers: tuple[str, ...]
    """Delimiter tokens the parser must see. Decoding keeps them even where the tokenizer marks them special."""
    detect: tuple[str, ...]
    """A chat template that contains any of these strings speaks this format (FORMATS order, first match)."""


# ---- shared helpers -------------------------------------------------------------------------------------------


def _load_json(text: str) -> Any:
    """``json.loads`` with every failure a ValueError: runaway nesting (a degenerate completion) included."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(exc.msg) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _json_arguments(name: str, raw: Any) -> ToolCall:
    """Arguments given as a JSON object, or as the text of one (every JSON-argument family)."""
    if isinstance(raw, str):
        try:
            raw = _load_json(raw)
        except ValueError as exc:
            return ToolCall(name, {}, f"arguments of {name} are not valid JSON ({exc})")
    if not isinstance(raw, dict):
        return ToolCall(name, {}, f"arguments of {name} are not an object")
    return ToolCall(name, raw)


def _json_call(text: str, key: str) -> ToolCall:
    """A call written as one JSON object ``{"name": ..., key: {...}}`` (hermes: arguments, llama3: parameters)."""
    try:
        data = _load_json(text)
    except ValueError as exc:
        return ToolCall("", {}, f"tool call is not valid JSON ({exc})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", {}, 'tool call needs a string "name"')
    return _json_arguments(data["name"], data.get(key, data.get("arguments", {})))


def _blocks(pattern: str, parse_call: Callable[[str, StringParams], ToolCall], drop: tuple[str, ...] = ()) -> Parser:
    """A format whose calls are delimited blocks. Well-formed blocks leave the content; malformed ones stay in it,
    so the next turn shows the model what it wrote. ``drop`` lists wrapper tokens around the blocks, which the chat
    template writes again for ``tool_calls``."""
    block = re.compile(pattern, re.DOTALL)

    def parse(text: str, strings: StringParams) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []

        def take(match: re.Match[str]) -> str:
            call = parse_call(match.group(1), strings)
            calls.append(call)
            return match.group(0) if call.error else ""

        content = block.sub(take, text)
        for token in drop if calls else ():
            content = content.replace(token, "")
        return content.strip(), calls

    return parse


# ---- one parser per family ------------------------------------------------------------------------------------


def parse_hermes_call(body: str, strings: StringParams) -> ToolCall:
    """Qwen/Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return _json_call(body, "arguments")


def parse_llama3(text: str, strings: StringParams) -> tuple[str, list[ToolCall]]:
    """Llama 3.x: the whole reply is ``{"name": ..., "parameters": {...}}`` (several joined by ``;``), optionally
    after ``<|python_tag|>``; a reply that does not start with ``{`` is plain text."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text.strip(), []
    return "", [_json_call(part, "parameters") for part in body.split(";") if part.strip()]


_DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_FENCED = re.compile(r"\s*([^\n]*?)\s*\n```(?:json)?[ \t]*\n(.*?)\n?```\s*", re.DOTALL)


def parse_deepseek_call(body: str, strings: StringParams) -> ToolCall:
    """DeepSeek, between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``: V3 and R1 write the type, the
    separator, the name, then the JSON arguments in a json code fence on the lines below; V3.1 writes
    ``NAME<｜tool▁sep｜>ARGS``."""
    kind, sep, rest = body.partition(_DEEPSEEK_SEP)
    if not sep:
        return ToolCall("", {}, f"tool call has no {_DEEPSEEK_SEP} before the function name")
    fenced = _DEEPSEEK_FENCED.fullmatch(rest)
    name, arguments = fenced.groups() if fenced else (kind.strip(), rest)
    if not name or any(c.isspace() for c in name):
        return ToolCall("", {}, f"tool call has no function name before {_DEEPSEEK_SEP} or ```json")
    return _json_arguments(name, arguments)


_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm4_call(body: str, strings: StringParams) -> ToolCall:
    """GLM-4.5+: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs. V is the raw text
    for a string parameter and JSON for anything else; V that is not valid JSON stays a string."""
    start = body.find("<arg_key>")
    name, pairs = (body, "") if start < 0 else (body[:start], body[start:])
    name = name.strip()
    if not name or any(c.isspace() or c in "<>" for c in name):
        return ToolCall("", {}, "tool call does not start with a function name")
    return _pair_arguments(name, pairs, _GLM_PAIR, "<arg_key>/<arg_value> pairs", strings, _json_or_text)


def _pair_arguments(
    name: str, pairs: str, pair: re.Pattern[str], what: str, strings: StringParams, typed: Callable[[str], Any]
) -> ToolCall:
    """Arguments written as key/value ``pair`` matches with only whitespace between them (GLM-4, Qwen3-Coder): a
    string parameter's value is its raw text, any other's is ``typed(value)``."""
    if pair.sub("", pairs).strip():
        return ToolCall(name, {}, f"arguments of {name} are not {what}")
    arguments = {}
    for key, value in pair.findall(pairs):
        key = key.strip()
        arguments[key] = value if key in strings.get(name, ()) else typed(value)
    return ToolCall(name, arguments)


def _json_or_text(value: str) -> Any:
    try:
        return _load_json(value)
    except ValueError:
        return value


_XML_FUNCTION = re.compile(r"\s*<function=([^\n>]+)>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^\n>]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def parse_qwen3_coder_call(body: str, strings: StringParams) -> ToolCall:
    """Qwen3-Coder, Qwen3.5, Qwen3.6: ``<function=NAME>``, then per argument ``<parameter=K>``, the value on the
    lines below, ``</parameter>``, then ``</function>``. The value is the raw text for a string parameter; for any
    other it is JSON, else Python's True/False/None (Qwen3.5's template writes scalars with ``| string``), else text."""
    function = _XML_FUNCTION.fullmatch(body)
    if function is None or not function.group(1).strip():
        return ToolCall("", {}, "tool call is not <function=NAME>...</function>")
    name, params = function.group(1).strip(), function.group(2)
    blocks = "<parameter=NAME>...</parameter> blocks"
    return _pair_arguments(name, params, _XML_PARAMETER, blocks, strings, _json_or_python_word)


def _json_or_python_word(value: str) -> Any:
    word = value.strip()
    return _PYTHON_WORDS[word] if word in _PYTHON_WORDS else _json_or_text(value)


_ESCAPE = "<escape>"
_GEMMA4_QUOTE = '<|"|>'
_GEMMA_CALL = re.compile(r"\s*call:([^\s{]+)\{")
_GEMMA_WORDS = {"true": True, "false": False, "null": None, "None": None}


def parse_gemma_call(body: str, strings: StringParams, quote: str = _ESCAPE) -> ToolCall:
    """FunctionGemma (Gemma 3) and Gemma 4: ``call:NAME{key:value,...}`` between ``<start_function_call>`` and
    ``<end_function_call>`` (Gemma 4: ``<|tool_call>`` and ``<tool_call|>``). Strings sit between ``quote`` marks
    (``<escape>``; Gemma 4's ``<|"|>``); numbers, true and false are bare; objects ``{...}`` and lists ``[...]``
    nest."""
    head = _GEMMA_CALL.match(body)
    if head is None:
        return ToolCall("", {}, "tool call is not of the form call:name{key:value,...}")
    name = head.group(1)
    try:
        arguments, end = _gemma_items(body, head.end(), "}", quote)
        if body[end:].strip():
            raise ValueError(f"text after the closing brace: {body[end:].strip()[:20]!r}")
    except RecursionError:
        return ToolCall(name, {}, f"bad arguments for {name}: nested too deeply")
    except ValueError as exc:
        return ToolCall(name, {}, f"bad arguments for {name}: {exc}")
    assert isinstance(arguments, dict)
    return ToolCall(name, arguments)


def _gemma_items(text: str, i: int, close: str, quote: str) -> tuple[dict[str, Any] | list[Any], int]:
    """The members of a ``{...}`` (close ``}``) or ``[...]`` (close ``]``) opened just before ``text[i]``."""
    items: dict[str, Any] | list[Any] = {} if close == "}" else []
    i = _skip_space(text, i)
    if text.startswith(close, i):
        return items, i + 1
    while True:
        if isinstance(items, dict):
            key, i = _gemma_key(text, i, quote)
            items[key], i = _gemma_value(text, i, quote)
        else:
            value, i = _gemma_value(text, i, quote)
            items.append(value)
        i = _skip_space(text, i)
        if text.startswith(close, i):
            return items, i + 1
        if not text.startswith(",", i):
            raise ValueError(f"expected ',' or {close!r} at {text[i : i + 20]!r}")
        i += 1


def _gemma_key(text: str, i: int, quote: str) -> tuple[str, int]:
    i = _skip_space(text, i)
    if text.startswith(quote, i):
        key, i = _gemma_value(text, i, quote)
    else:
        end = text.find(":", i)
        key, i = (text[i:end].strip(), end) if end >= 0 else ("", len(text))
    i = _skip_space(text, i)
    if not key or not text.startswith(":", i):
        raise ValueError(f"expected key: at {text[i : i + 20]!r}")
    return str(key), i + 1


def _gemma_value(text: str, i: int, quote: str) -> tuple[Any, int]:
    """One value starting at ``text[i]``, and the index just after it."""
    i = _skip_space(text, i)
    if text.startswith(quote, i):
        end = text.find(quote, i + len(quote))
        if end < 0:
            raise ValueError(f"a string opened with {quote} is never closed")
        return text[i + len(quote) : end], end + len(quote)
    if text.startswith("{", i):
        return _gemma_items(text, i + 1, "}", quote)
    if text.startswith("[", i):
        return _gemma_items(text, i + 1, "]", quote)
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[i:end].strip()
    if word in _GEMMA_WORDS:
        return _GEMMA_WORDS[word], end
    try:
        number = _load_json(word)
    except ValueError:
        number = None
    if not isinstance(number, int | float):
        raise ValueError(f"{word!r} is neither a number, true, false nor a string between {quote} marks")
    return number, end


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


_TINY_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.DOTALL)


def parse_tiny_call(body: str, strings: StringParams) -> ToolCall:
    """The embedded character-level model: ``<tool_call>name(key=json, ...)</tool_call>``."""
    match = _TINY_CALL.match(body)
    if match is None:
        return ToolCall("", {}, "tool call is not of the form name(key=value, ...)")
    try:
        node = ast.parse(f"f({match.group(2)})", mode="eval").body
        assert isinstance(node, ast.Call)
        if node.args:
            raise ValueError("positional arguments are not allowed")
        arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except (SyntaxError, ValueError, RecursionError) as exc:
        return ToolCall(match.group(1), {}, f"bad arguments for {match.group(1)}: {exc}")
    return ToolCall(match.group(1), arguments)


def _literal(node: ast.expr) -> Any:
    """A JSON literal: Python literals plus true/false/null."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    return ast.literal_eval(node)


_DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", _DEEPSEEK_SEP, "<｜tool▁call▁end｜>",
                     "<｜tool▁calls▁end｜>")  # fmt: skip
_HERMES_BLOCK = r"<tool_call>(.*?)</tool_call>"

_FORMATS = (
    ToolFormat("tiny", _blocks(_HERMES_BLOCK, parse_tiny_call), ("<tool_call>", "</tool_call>"), (TINY_MARKER,)),
    ToolFormat(
        "deepseek_v3",
        _blocks(
            r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>",
            parse_deepseek_call,
            drop=(_DEEPSEEK_MARKERS[0], _DEEPSEEK_MARKERS[-1]),
        ),
        markers=_DEEPSEEK_MARKERS,
        detect=("<｜tool▁call▁begin｜>",),
    ),
    ToolFormat(
        "glm4",
        _blocks(_HERMES_BLOCK, parse_glm4_call),
        markers=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        detect=("<arg_key>",),
    ),
    ToolFormat(
        "qwen3_coder",
        _blocks(_HERMES_BLOCK, parse_qwen3_coder_call),
        markers=("<tool_call>", "</tool_call>"),
        detect=("<function=",),
    ),
    ToolFormat(
        "functiongemma",
        _blocks(
            r"<start_function_call>(.*?)<end_function_call>",
            parse_gemma_call,
            drop=("<start_function_response>",),
        ),
        markers=("<start_function_call>", "<end_function_call>", _ESCAPE),
        detect=("<start_function_call>",),
    ),
    ToolFormat(
        "gemma4",
        _blocks(
            r"<\|tool_call>(.*?)<tool_call\|>",
            functools.partial(parse_gemma_call, quote=_GEMMA4_QUOTE),
            drop=("<|tool_response>",),
        ),
        markers=("<|tool_call>", "<tool_call|>", _GEMMA4_QUOTE),
        detect=("<|tool_call>",),
    ),
    ToolFormat("llama3", parse_llama3, ("<|python_tag|>",), ("<|python_tag|>", "<|start_header_id|>")),
    ToolFormat("hermes", _blocks(_HERMES_BLOCK, parse_hermes_call), ("<tool_call>", "</tool_call>"), ()),
)
FORMAT_TABLE: dict[str, ToolFormat] = {fmt.name: fmt for fmt in _FORMATS}
"""Every format by name, in detection order: the most specific markers first, hermes (the default) last."""
FORMATS = tuple(FORMAT_TABLE)


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template speaks: the first format whose markers it contains, else hermes."""
    template = chat_template or ""
    return next((fmt.name for fmt in FORMAT_TABLE.values() if any(m in template for m in fmt.detect)), "hermes")


def string_params(schemas: list[dict[str, Any]] | None) -> StringParams:
    """Tool name -> parameters typed ``string`` in its JSON schema (as built by rollout/tools.py's tool_schemas)."""
    out: dict[str, frozenset[str]] = {}
    for schema in schemas or []:
        function = schema.get("function", schema)
        properties = (function.get("parameters") or {}).get("properties") or {}
        out[function["name"]] = frozenset(k for k, p in properties.items() if p.get("type") == "string")
    return out


def parse_tool_calls(text: str, fmt: str, schemas: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """(the text without the well-formed calls, the calls in emitted order) for format ``fmt``."""
    if fmt not in FORMAT_TABLE:
        raise ValueError(f"rollout.tool_call_format={fmt!r}: expected one of {FORMATS} or auto")
    return FORMAT_TABLE[fmt].parse(text, string_params(schemas))


def decode_turn(tokenizer: Any, token_ids: list[int], fmt: str | None) -> str:
    """A turn's text with special tokens skipped, except the tool-call markers of format ``fmt``. Some families
    mark their call delimiters special, and ``skip_special_tokens=True`` would erase the very calls to parse."""
    kept = _special_markers(tokenizer, fmt)
    if not kept:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    hidden = (special | set(tokenizer.all_special_ids)) - kept
    return tokenizer.decode([t for t in token_ids if t not in hidden], skip_special_tokens=False)


def _special_markers(tokenizer: Any, fmt: str | None) -> set[int]:
    """Ids of ``fmt``'s markers that the tokenizer marks special (none: plain decoding keeps every marker)."""
    if fmt is None or fmt not in FORMAT_TABLE:
        return set()
    markers = FORMAT_TABLE[fmt].markers
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {i for i, token in added.items() if token.special and token.content in markers}
