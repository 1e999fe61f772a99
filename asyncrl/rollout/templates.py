"""Training-safe chat templates for known model families, swapped in so tool loops stay prefix-preserving.

A multi-turn rollout re-renders the whole conversation every turn. Stock templates that rewrite earlier turns
(Qwen3 drops the ``<think>`` reasoning of every assistant turn before the last user message) make each turn fork
a new training sample. The templates here render every assistant turn exactly as the model generated it, in the
family's own markers, so the rendering of turn k+1 starts with the tokens held after turn k.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SETTINGS = ("auto", "keep")

# Qwen3 format: <|im_start|>ROLE\n...<|im_end|>\n turns; reasoning in <think>\n...\n</think>\n\n before the reply;
# calls as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>; consecutive tool results in one user turn
# of <tool_response> blocks; tool schemas as JSON lines inside <tools> in the system turn.
QWEN3_TEMPLATE = """\
{#- asyncrl training-safe Qwen3 template: assistant turns render as generated, earlier reasoning included. -#}
{%- set thinking_off = enable_thinking is defined and enable_thinking is false -%}
{%- set ns = namespace(system=none, start=0) -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content -%}
  {%- set ns.start = 1 -%}
{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}
  {{- '# Tools\\n\\nFunctions you can call, one JSON signature per line inside <tools></tools>:\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nTo call a function, put a JSON object with its name and arguments inside '
      '<tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
      '<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif ns.system is not none -%}
  {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set turns = messages[ns.start:] -%}
{%- for message in turns -%}
  {%- set content = message.content if message.content is string else '' -%}
  {%- if message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if message.reasoning_content is string -%}
      {{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' -}}
    {%- elif content.lstrip().startswith('<think>') and '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[1:] | join('</think>') -%}
      {%- set content = content.lstrip() -%}
      {{- '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' -}}
    {%- elif thinking_off -%}
      {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- content -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
      {{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or turns[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
    {%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if thinking_off -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


# DeepSeek-V3 / R1 format (TRL ships a patched template for it too): bos, the system prompts, then <｜User｜>...
# and <｜Assistant｜>...<｜end▁of▁sentence｜> turns; calls as <｜tool▁calls▁begin｜> + one <｜tool▁call▁begin｜>function
# <｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜> per call (newline-separated) + <｜tool▁calls▁end｜>; the
# results of one round in <｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>, after which the model answers without a
# new <｜Assistant｜>. The stock template concatenates the arguments as text, so the object the parser yields
# crashes it, and never closes the outputs before a second round of calls. ``think`` is R1's generation prefix.
_DEEPSEEK_BODY = """\
{%- set ns = namespace(system='', after_tool=false) -%}
{%- for message in messages if message.role == 'system' -%}
  {%- set ns.system = ns.system + ('\\n\\n' if not loop.first else '') + message.content -%}
{%- endfor -%}
{{- bos_token -}}{{- ns.system -}}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else '' -%}
  {%- if message.role == 'user' -%}
    {{- '<｜User｜>' + content -}}
    {%- set ns.after_tool = false -%}
  {%- elif message.role == 'assistant' -%}
    {%- if not ns.after_tool -%}
      {{- '<｜Assistant｜>' -}}
      {%- if think and '</think>' in content and not content.lstrip().startswith('<think>') -%}
        {{- think -}}
      {%- endif -%}
    {%- endif -%}
    {{- content -}}
    {%- if message.tool_calls -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for call in message.tool_calls -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}
        {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + fn.name + '\\n```json\\n' -}}
        {{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '\\n```<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
    {%- set ns.after_tool = false -%}
  {%- elif message.role == 'tool' -%}
    {%- if not ns.after_tool -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- endif -%}
    {{- '<｜tool▁output▁begin｜>' + content + '<｜tool▁output▁end｜>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}
    {%- set ns.after_tool = true -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.after_tool -%}{{- '<｜Assistant｜>' + think -}}{%- endif -%}
"""
DEEPSEEK_V3_TEMPLATE = (
    "{#- asyncrl training-safe DeepSeek-V3 template: turns render as generated; arguments may be objects. -#}\n"
    "{%- set think = '' -%}\n" + _DEEPSEEK_BODY
)
DEEPSEEK_R1_TEMPLATE = (
    "{#- asyncrl training-safe DeepSeek-R1 template: turns render as generated, reasoning included. -#}\n"
    "{%- set think = '<think>\\n' -%}\n" + _DEEPSEEK_BODY
)


@dataclass(frozen=True)
class Family:
    """A model family recognised from its tokenizer, with the template that keeps its tool loops prefix-preserving."""

    name: str
    detect: Callable[[Any], bool]
    template: str


def _is_qwen3(tokenizer: Any) -> bool:
    """Qwen3's tokens are in the vocabulary and its stock template speaks them (not the model name: fine-tunes)."""
    vocab = tokenizer.get_vocab()
    tokens = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<tool_response>")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return all(t in vocab for t in tokens) and all(m in template for m in ("<|im_start|>", "<think>", "<tool_call>"))


def _is_deepseek(tokenizer: Any, *, thinks: bool) -> bool:
    """DeepSeek's tool tokens are in the vocabulary and its stock template writes V3's fenced JSON calls (V3.1's
    unfenced calls are another format); R1's generation prompt opens a <think> block, V3's does not."""
    vocab = tokenizer.get_vocab()
    tokens = ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    speaks = all(t in vocab for t in tokens) and "<｜tool▁calls▁begin｜>" in template and "```json" in template
    return speaks and ("<｜Assistant｜><think>" in template) == thinks


FAMILIES = (
    Family("qwen3", _is_qwen3, QWEN3_TEMPLATE),
    Family("deepseek_r1", functools.partial(_is_deepseek, thinks=True), DEEPSEEK_R1_TEMPLATE),
    Family("deepseek_v3", functools.partial(_is_deepseek, thinks=False), DEEPSEEK_V3_TEMPLATE),
)


def detect_family(tokenizer: Any) -> Family | None:
    """The known family whose markers the tokenizer carries, or None."""
    return next((family for family in FAMILIES if family.detect(tokenizer)), None)


def read_template(path: str) -> str:
    """A chat template file named by ``rollout.chat_template``."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"rollout.chat_template={path!r} is neither auto, keep nor an existing .jinja file")
    return file.read_text()


def use_chat_template(
    tokenizer: Any, setting: str, *, agentic: bool, chat_template_kwargs: dict[str, Any], model: str
) -> str | None:
    """Set ``tokenizer.chat_template`` per ``rollout.chat_template`` (auto|keep|path); the family swapped, or None.
    With tools, a template that cannot render a tool round at all is refused (the tool loop would crash on it).

    The tokenizer is the one pickled into the rollout worker and saved with every checkpoint, so the template
    the model is trained on is also the one it is served with afterwards."""
    swapped = _swap_template(tokenizer, setting, agentic=agentic, chat_template_kwargs=chat_template_kwargs,
                             model=model)  # fmt: skip
    if agentic and tokenizer.chat_template is not None:
        check_renders_tool_round(tokenizer, chat_template_kwargs, model)
    return swapped


def _swap_template(
    tokenizer: Any, setting: str, *, agentic: bool, chat_template_kwargs: dict[str, Any], model: str
) -> str | None:
    from asyncrl.rollout.tools import template_preserves_prefix

    if setting == "keep":
        return None
    if setting != "auto":
        tokenizer.chat_template = read_template(setting)
        log.info("chat template of %s: %s (rollout.chat_template)", model, setting)
        return None
    if not agentic or template_preserves_prefix(tokenizer, chat_template_kwargs):
        return None
    family = detect_family(tokenizer)
    if family is None:
        return None
    tokenizer.chat_template = family.template
    log.info("chat template of %s is not prefix-preserving for tool turns: using asyncrl's training-safe %s "
             "template, saved with the checkpoints too (rollout.chat_template=auto; keep disables it)",
             model, family.name)  # fmt: skip
    return family.name


def check_renders_tool_round(tokenizer: Any, chat_template_kwargs: dict[str, Any], model: str) -> None:
    """Refuse a chat template that raises on a tool call and its result (Gemma 3's, which has no tool role; stock
    DeepSeek-V3's under ``keep``, which cannot take arguments as an object): the tool loop renders exactly that
    at its second turn, mid-run."""
    from asyncrl.config.errors import ConfigError
    from asyncrl.rollout.tools import render_tool_round

    try:
        render_tool_round(tokenizer, chat_template_kwargs)
    except Exception as exc:
        reason = (str(exc).splitlines() or [""])[0]
        raise ConfigError(
            f"the chat template of {model} cannot render a tool call and its result ({type(exc).__name__}: {reason}); "
            f"tools need one that can: rollout.chat_template=auto swaps one in for {[f.name for f in FAMILIES]}, "
            "else give rollout.chat_template=PATH.jinja"
        ) from exc
