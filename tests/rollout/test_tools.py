"""Tool-call parsing per format (malformed calls included) and running calls off the event loop."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from asyncrl.rollout.tools import ToolStats, detect_format, parse_tool_calls, run_tool_calls, tool_schemas


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom() -> int:
    """Always fails."""
    raise RuntimeError("kaput")


def slow() -> str:
    """Sleeps, like a slow sync tool."""
    time.sleep(0.3)
    return "done"


def test_hermes_calls_in_order_and_malformed_block_kept_in_content():
    text = ('Let me.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 3}</tool_call>'
            '<tool_call>{"name": "boom", "arguments": "{}"}</tool_call>')  # fmt: skip
    content, calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("add", {"a": 1, "b": 2}, True), ("", {}, False), ("boom", {}, True)]  # fmt: skip
    assert content.startswith("Let me.<tool_call>") and "boom" not in content


def test_llama3_json_calls_with_python_tag_and_plain_text():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                      '{"name": "add", "parameters": {"a": 5, "b": 6}}', "llama3")  # fmt: skip
    assert content == "" and [c.arguments for c in calls] == [{"a": 1, "b": 2}, {"a": 5, "b": 6}]
    assert parse_tool_calls("The answer is 3.", "llama3") == ("The answer is 3.", [])
    (bad,) = parse_tool_calls('{"name": "add", "parameters": {', "llama3")[1]
    assert bad.error is not None


def test_tiny_format_keyword_literals_and_malformed():
    _, calls = parse_tool_calls("<tool_call>add(a=1, b=2)</tool_call><tool_call>f(x=true, y=\"s\")</tool_call>"
                                "<tool_call>add(1, 2)</tool_call><tool_call>oops</tool_call>", "tiny")  # fmt: skip
    assert (calls[0].name, calls[0].arguments) == ("add", {"a": 1, "b": 2})
    assert calls[1].arguments == {"x": True, "y": "s"}
    assert calls[2].error is not None and calls[3].error is not None


def test_detect_format_and_schemas():
    assert detect_format("{#- tool-call format: tiny -#}") == "tiny"
    assert detect_format("<|start_header_id|>{{ x }}") == "llama3"
    assert detect_format("<tool_call>") == "hermes" and detect_format(None) == "hermes"
    (schema,) = tool_schemas([add])
    assert schema["function"]["name"] == "add" and set(schema["function"]["parameters"]["properties"]) == {"a", "b"}


def test_failures_become_tool_messages_and_count():
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                                '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                                '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>'
                                '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
                                '<tool_call>{"name": "async_add", "arguments": {"a": 2, "b": 2}}</tool_call>'
                                '<tool_call>{"name": "ad", "arguments": {"a": 1, "b": 2}}</tool_call>',
                                "hermes")  # fmt: skip
    stats = ToolStats()
    tools = {"add": add, "boom": boom, "async_add": async_add}
    results = asyncio.run(run_tool_calls(calls, tools, None, stats))
    assert [r["content"][:6] for r in results] == ["3", "Error:", "Error:", "Error:", "4", "Error:"]
    assert "kaput" in results[3]["content"] and stats.unknown_names == 2 and stats.failures == 4
    assert stats.parallel == [6]
    assert [name for name, _, _ in stats.calls] == ["add", "<unknown>", "add", "boom", "async_add", "<unknown>"]


def test_slow_sync_tools_do_not_stall_other_rollouts():
    """Eight rollouts each calling a 0.3 s sync tool finish together in ~0.3 s, and the loop keeps ticking."""
    _, calls = parse_tool_calls('<tool_call>{"name": "slow", "arguments": {}}</tool_call>', "hermes")
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def main():
        task = asyncio.create_task(ticker())
        with ThreadPoolExecutor(8) as pool:
            started = time.monotonic()
            await asyncio.gather(*(run_tool_calls(calls, {"slow": slow}, pool, ToolStats()) for _ in range(8)))
            elapsed = time.monotonic() - started
        task.cancel()
        return elapsed

    elapsed = asyncio.run(main())
    assert elapsed < 1.0, f"8 x 0.3 s tools took {elapsed:.2f} s: they ran one after another"
    # the event loop kept ticking while the tools slept (a count, not a gap: a loaded machine stalls any thread)
    assert len(ticks) >= 5, f"the event loop ticked {len(ticks)} times in {elapsed:.2f} s"
