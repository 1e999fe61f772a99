"""Tool-call formats per family. Golden round trips: calls rendered by each family's published chat template
(tests/rollout/fixtures/README.md names the sources) are tokenized, decoded the way the rollout loop decodes a
turn, and parsed back to the same calls. Then raw model output: several calls, and malformed ones that fail
as tool results and are counted, the way hermes's are."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.rollout.templates import use_chat_template
from asyncrl.rollout.tool_formats import FORMATS, decode_turn, detect_format, parse_tool_calls
from asyncrl.rollout.tools import ToolStats, run_tool_calls, tool_schemas

ASSET = Path(__file__).parents[2] / "asyncrl" / "assets" / "tiny-counter"
FIXTURES = Path(__file__).parent / "fixtures"


def add(a: int, note: str) -> str:
    """
    Adds one to a, with a note.

    Args:
        a: The number.
        note: Free text; "42" stays a string.
    """
    return f"{a + 1} ({note})"


SCHEMAS = tool_schemas([add])


@dataclass(frozen=True)
class Family:
    fixture: str
    fmt: str
    special: tuple[str, ...]
    """The family's special tokens in a rendered turn, its call markers included: the tokenizer marks them all
    special, the hardest case for decoding (some families do, and skip_special_tokens would erase the calls)."""
    max_calls: int = 2
    string_arguments: bool = False
    """The stock template concatenates the arguments as text (DeepSeek's), so they go in as a JSON string."""


FAMILIES = {
    "llama3": Family("llama3_2.jinja", "llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                                  "<|python_tag|>"), max_calls=1),
    "deepseek_v3": Family("deepseek_v3.jinja", "deepseek_v3", ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                          "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                          "<｜tool▁calls▁end｜>"), string_arguments=True),
    "glm4": Family("glm4_5.jinja", "glm4", ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                   "<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                   "</arg_value>")),
    "functiongemma": Family("functiongemma.jinja", "functiongemma", ("<start_of_turn>", "<end_of_turn>",
                            "<start_function_call>", "<end_function_call>", "<start_function_response>",
                            "<end_function_response>", "<escape>")),
    "gemma4": Family("gemma4.jinja", "gemma4", ("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                     "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>')),
    "qwen3_5": Family("qwen3_5_nothink.jinja", "qwen3_coder", ("<|im_start|>", "<|im_end|>", "<think>", "</think>",
                      "<tool_call>", "</tool_call>")),
    "qwen3_6": Family("qwen3_6.jinja", "qwen3_coder", ("<|im_start|>", "<|im_end|>", "<think>", "</think>",
                      "<tool_call>", "</tool_call>")),
}  # fmt: skip


def family_tokenizer(family: Family):
    """The tiny-counter tokenizer (printable ASCII, one token per character) carrying the family's special tokens
    and its published chat template."""
    tokenizer = AutoTokenizer.from_pretrained(ASSET)
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.special)})
    tokenizer.chat_template = (FIXTURES / family.fixture).read_text()
    return tokenizer


def rendered_turn(tokenizer, calls: list[dict], string_arguments: bool) -> str:
    """The assistant turn that makes ``calls`` after one user message, as the chat template renders it: what
    follows the rendered prompt (or, where the generation prompt differs from the turn's header, their common
    part)."""
    encode = json.dumps if string_arguments else lambda arguments: arguments
    tool_calls = [{"type": "function", "function": {"name": c["name"], "arguments": encode(c["arguments"])}}
                  for c in calls]  # fmt: skip
    user = [{"role": "user", "content": "Add one to 1 and to 2."}]
    turn = {"role": "assistant", "content": "Adding.", "tool_calls": tool_calls}
    prompt = tokenizer.apply_chat_template(user, tools=SCHEMAS, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*user, turn], tools=SCHEMAS, tokenize=False)
    return full[len(os.path.commonprefix([prompt, full])) :]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_family_template_is_detected(name):
    family = FAMILIES[name]
    assert detect_format((FIXTURES / family.fixture).read_text()) == family.fmt


@pytest.mark.parametrize("name", FAMILIES)
def test_calls_rendered_by_the_family_template_parse_back(name):
    family = FAMILIES[name]
    tokenizer = family_tokenizer(family)
    calls = [{"name": "add", "arguments": {"a": 1, "note": "42"}},
             {"name": "add", "arguments": {"a": 2, "note": "x, y"}}][: family.max_calls]  # fmt: skip
    turn = rendered_turn(tokenizer, calls, family.string_arguments)
    ids = tokenizer.encode(turn, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids, "the tiny tokenizer lost a character of the turn"
    content, parsed = parse_tool_calls(decode_turn(tokenizer, ids, family.fmt), family.fmt, SCHEMAS)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(c["name"], c["arguments"], None) for c in calls]
    assert "add" not in content and ("Adding." in content or family.fmt == "llama3")


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_6"])
def test_auto_keeps_the_qwen3_5_templates_so_the_loop_reads_the_calls_they_ask_for(name):
    """Their stock templates keep tool rounds prefix-preserving, so rollout.chat_template=auto leaves them (Qwen3's
    training-safe template would ask for hermes JSON calls the model was not trained to write)."""
    tokenizer = family_tokenizer(FAMILIES[name])
    assert use_chat_template(tokenizer, "auto", agentic=True, chat_template_kwargs={}, model=name) is None
    assert tokenizer.chat_template == (FIXTURES / FAMILIES[name].fixture).read_text()


def test_decoding_keeps_special_markers_and_nothing_else():
    tokenizer = family_tokenizer(FAMILIES["glm4"])
    ids = tokenizer.encode("<|assistant|>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
                           "</tool_call><|observation|>", add_special_tokens=False)  # fmt: skip
    assert parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True), "glm4")[1] == []
    text = decode_turn(tokenizer, ids, "glm4")
    assert text == "\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
    assert decode_turn(tokenizer, ids, None) == tokenizer.decode(ids, skip_special_tokens=True)


def test_deepseek_calls_v3_and_v31_syntax_and_malformed():
    begin, end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    text = (f"Let me add.<｜tool▁calls▁begin｜>{begin}function{sep}add\n```json\n"
            f"{{\"a\": 1, \"note\": \"n\"}}\n```{end}\n"
            f"{begin}add{sep}{{\"a\": 2, \"note\": \"m\"}}{end}\n"
            f"{begin}function{sep}add\n```json\n{{\"a\": 3,\n```{end}"
            f"{begin}add {{\"a\": 4}}{end}<｜tool▁calls▁end｜>")  # fmt: skip
    content, calls = parse_tool_calls(text, "deepseek_v3")
    assert [(c.name, c.arguments) for c in calls[:2]] == [("add", {"a": 1, "note": "n"}),
                                                          ("add", {"a": 2, "note": "m"})]  # fmt: skip
    assert calls[2].error == "arguments of add are not valid JSON (Expecting property name enclosed in double quotes)"
    assert "no <｜tool▁sep｜>" in calls[3].error
    assert content.startswith("Let me add.") and content.count(begin) == 2 and "calls▁begin" not in content


@pytest.mark.parametrize(
    ("fmt", "text", "second", "errors", "start"),
    [
        ("glm4", "<think>plan</think>\nSure.\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>7</arg_value>\n"
                 "<arg_key>note</arg_key>\n<arg_value>42</arg_value>\n</tool_call>\n"
                 "<tool_call>lookup\n<arg_key>q</arg_key>\n<arg_value>{\"k\": [1, true]}</arg_value>\n"
                 "<arg_key>raw</arg_key><arg_value>not json</arg_value>\n</tool_call>"
                 "<tool_call>add\n<arg_key>a</arg_key>\n</tool_call>"
                 "<tool_call>\n<arg_key>a</arg_key></tool_call>",
         {"q": {"k": [1, True]}, "raw": "not json"},
         ["arguments of add are not <arg_key>/<arg_value> pairs", "tool call does not start with a function name"],
         "<think>plan</think>\nSure."),
        ("qwen3_coder", "Sure.\n\n<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=note>\n"
                        "42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=plot>\n<parameter=data>\n"
                        "[1, 2.5]\n</parameter>\n<parameter=grid>\nTrue\n</parameter>\n<parameter=title>\nline one\n"
                        "line two\n</parameter>\n<parameter=none>\nNone\n</parameter>\n</function>\n</tool_call>\n"
                        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>\n"
                        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
         {"data": [1, 2.5], "grid": True, "title": "line one\nline two", "none": None},  # Qwen3.5 writes True, None
         ["arguments of add are not <parameter=NAME>...</parameter> blocks",
          "tool call is not <function=NAME>...</function>"],
         "Sure."),
    ],
)  # fmt: skip
def test_values_are_typed_by_the_schema_and_malformed_calls_fail(fmt, text, second, errors, start):
    content, calls = parse_tool_calls(text, fmt, SCHEMAS)
    assert (calls[0].name, calls[0].arguments) == ("add", {"a": 7, "note": "42"})
    assert calls[1].arguments == second
    assert [calls[2].error, calls[3].error] == errors
    assert parse_tool_calls(text, fmt)[1][0].arguments == {"a": 7, "note": 42}  # without schemas: JSON wins
    assert content.startswith(start) and content.count("<tool_call>") == 2


def test_functiongemma_nested_values_and_malformed_calls():
    text = ("<start_function_call>call:add{a:1,note:<escape>x, {y}<escape>}<end_function_call>"
            "<start_function_call>call:plot{data:[1,2.5,-3e2],opts:{grid:true,title:<escape>T<escape>},none:None}"
            "<end_function_call><start_function_call>call:add{a:<escape>open}<end_function_call>"
            "<start_function_call>call:add{a:one}<end_function_call>"
            "<start_function_call>add(a=1)<end_function_call><start_function_response>")  # fmt: skip
    content, calls = parse_tool_calls(text, "functiongemma")
    assert (calls[0].name, calls[0].arguments) == ("add", {"a": 1, "note": "x, {y}"})
    assert calls[1].arguments == {"data": [1, 2.5, -300.0], "opts": {"grid": True, "title": "T"}, "none": None}
    assert [c.error is not None for c in calls] == [False, False, True, True, True]
    assert "never closed" in calls[2].error and "'one' is neither" in calls[3].error
    assert "<start_function_response>" not in content and content.count("<start_function_call>") == 3


def test_gemma4_quotes_nested_values_and_malformed_calls():
    q = '<|"|>'
    text = (f"<|tool_call>call:add{{a:1,note:{q}x, {{y}}{q}}}<tool_call|>"
            f"<|tool_call>call:plot{{data:[1,2.5],opts:{{{q}grid{q}:true,title:{q}T{q}}}}}<tool_call|>"
            f"<|tool_call>call:add{{a:<escape>1<escape>}}<tool_call|><|tool_response>")  # fmt: skip
    content, calls = parse_tool_calls(text, "gemma4")
    assert (calls[0].name, calls[0].arguments) == ("add", {"a": 1, "note": "x, {y}"})
    assert calls[1].arguments == {"data": [1, 2.5], "opts": {"grid": True, "title": "T"}}
    assert calls[2].error is not None  # FunctionGemma's <escape> is no quote in Gemma 4
    assert "<|tool_response>" not in content and content.count("<|tool_call>") == 1


def test_a_runaway_qwen3_coder_value_stays_text():
    runaway = "<tool_call><function=add><parameter=a>" + "[" * 100_000 + "</parameter></function></tool_call>"
    assert parse_tool_calls(runaway, "qwen3_coder")[1][0].arguments == {"a": "[" * 100_000}


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1, \"note\": \"n\"}"
                        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>"
                        "<｜tool▁calls▁end｜>"),
        ("glm4", "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>note</arg_key>\n"
                 "<arg_value>n</arg_value>\n</tool_call><tool_call>add\nstray</tool_call>"),
        ("functiongemma", "<start_function_call>call:add{a:1,note:<escape>n<escape>}<end_function_call>"
                          "<start_function_call>call:add{a:1<end_function_call>"),
        ("gemma4", '<|tool_call>call:add{a:1,note:<|"|>n<|"|>}<tool_call|><|tool_call>call:add{a:1<tool_call|>'),
        ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=note>\nn\n"
                        "</parameter>\n</function>\n</tool_call><tool_call>\n<function=add>\n</tool_call>"),
    ],
)  # fmt: skip
def test_malformed_calls_fail_as_tool_results_and_count(fmt, text):
    _, calls = parse_tool_calls(text, fmt, SCHEMAS)
    stats = ToolStats()
    results = asyncio.run(run_tool_calls(calls, {"add": add}, None, stats))
    assert [r["content"][:6] for r in results] == ["2 (n)", "Error:"] and stats.failures == 1


def test_every_format_is_named_and_unknown_ones_refused():
    assert set(FORMATS) == {"tiny", "deepseek_v3", "glm4", "qwen3_coder", "functiongemma", "gemma4", "llama3", "hermes"}
    with pytest.raises(ValueError, match="rollout.tool_call_format='mistral'"):
        parse_tool_calls("", "mistral")


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("hermes", "<tool_call>" + "[" * 100_000 + "</tool_call>"),
        ("deepseek_v3", "<｜tool▁call▁begin｜>add<｜tool▁sep｜>" + "[" * 100_000 + "<｜tool▁call▁end｜>"),
        ("functiongemma", "<start_function_call>call:add{a:" + "[" * 100_000 + "<end_function_call>"),
        ("gemma4", "<|tool_call>call:add{a:" + "[" * 100_000 + "<tool_call|>"),
        ("tiny", "<tool_call>add(a=" + "[" * 100_000 + ")</tool_call>"),
    ],
    ids=["hermes", "deepseek_v3", "functiongemma", "gemma4", "tiny"],
)
def test_a_degenerate_completion_nested_without_end_is_a_failed_call_not_a_crash(fmt, text):
    (call,) = parse_tool_calls(text, fmt)[1]
    assert call.error is not None
