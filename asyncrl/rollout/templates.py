"""Training-safe chat templates for known model families, swapped in so tool loops stay prefix-preserving.

A multi-turn rollout re-renders the whole conversation every turn. Stock templates that rewrite earlier turns
(Qwen3 drops the ``<think>`` reasoning of every assistant turn before the last user message) make each turn fork
a new training sample, and those that raise on a turn the model may write (Llama 3.x's, on several tool calls) end
the rollout. The templates here render every assistant turn exactly as the model generated it, in the family's own
markers, so the rendering of turn k+1 starts with the tokens held after turn k.
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


# Llama 3.x format (3.1 to 3.3 write calls alike): bos, a system header (Environment: ipython with tools, the knowledge
# cutoff and today's date), then <|start_header_id|>ROLE<|end_header_id|>\n\n...<|eot_id|> turns; the tool schemas go
# into the first user message (or the system turn with tools_in_user_message=false); a call is the whole reply,
# {"name": ..., "parameters": {...}}; each result is an ipython turn of its JSON. The stock templates raise on a turn
# of several calls and trim every reply; here the calls of a turn are joined by "; " (how the llama3 parser splits
# them) and replies render as generated. ``default_date`` is each stock template's: 3.1 and 3.3 a fixed date, 3.2
# today's. Llama 3.1's builtin_tools (brave_search, wolfram_alpha) are not rendered: asyncrl's tools are functions.
_LLAMA3_BODY = """\
{%- set tools = custom_tools if custom_tools is defined else (tools if tools is defined else none) -%}
{%- set tools_first = tools_in_user_message if tools_in_user_message is defined else true -%}
{%- set today = date_string if date_string is defined else default_date -%}
{%- set ns = namespace(system='', turns=messages) -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content | trim -%}
  {%- set ns.turns = messages[1:] -%}
{%- endif -%}
{%- set format = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                 'value}.Do not use variables.\\n\\n' -%}
{{- bos_token -}}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}
{%- if tools is not none -%}{{- 'Environment: ipython\\n' -}}{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + today + '\\n\\n' -}}
{%- if tools is not none and not tools_first -%}
  {{- 'You have access to the following functions. To call a function, please respond with JSON for a function '
      'call.' + format -}}
  {%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}
{%- endif -%}
{{- ns.system + '<|eot_id|>' -}}
{%- if tools is not none and tools_first -%}
  {%- if not ns.turns -%}
    {{- raise_exception('Llama 3 puts the tools in the first user message, and there is none') -}}
  {%- endif -%}
  {{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a '
      'function call with its proper arguments that best answers the given prompt.\\n\\n' + format -}}
  {%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}
  {{- (ns.turns[0].content | trim) + '<|eot_id|>' -}}
  {%- set ns.turns = ns.turns[1:] -%}
{%- endif -%}
{%- for message in ns.turns -%}
  {%- if message.role == 'tool' or message.role == 'ipython' -%}
    {%- set result = message.content -%}
    {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' -}}
    {{- (result | tojson if result is mapping or result is iterable else result) ~ '<|eot_id|>' -}}
  {%- elif message.role == 'assistant' and message.tool_calls -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
    {%- for call in message.tool_calls -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if not loop.first -%}{{- '; ' -}}{%- endif -%}
      {{- '{"name": "' + fn.name + '", "parameters": ' -}}
      {{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}' -}}
    {%- endfor -%}
    {{- '<|eot_id|>' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set reply = message.content if message.content is string else '' -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + reply + '<|eot_id|>' -}}
  {%- else -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""
LLAMA3_1_TEMPLATE = (
    "{#- asyncrl training-safe Llama 3.1/3.3 template: several tool calls a turn; replies render as generated. -#}\n"
    "{%- set default_date = '26 Jul 2024' -%}\n" + _LLAMA3_BODY
)
LLAMA3_2_TEMPLATE = (
    "{#- asyncrl training-safe Llama 3.2 template: several tool calls a turn; replies render as generated. -#}\n"
    "{%- set default_date = strftime_now('%d %b %Y') if strftime_now is defined else '26 Jul 2024' -%}\n" + _LLAMA3_BODY
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


def _is_llama3(tokenizer: Any, *, dated: bool) -> bool:
    """Llama 3's header and turn tokens are in the vocabulary and its stock template writes calls with "parameters";
    3.2's dates the system turn today (strftime_now), 3.1's and 3.3's with a fixed date."""
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    tokens = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    speaks = all(t in vocab for t in tokens) and '"parameters": ' in template and "tool_calls" in template
    return speaks and ("strftime_now" in template) == dated


FAMILIES = (
    Family("qwen3", _is_qwen3, QWEN3_TEMPLATE),
    Family("deepseek_r1", functools.partial(_is_deepseek, thinks=True), DEEPSEEK_R1_TEMPLATE),
    Family("deepseek_v3", functools.partial(_is_deepseek, thinks=False), DEEPSEEK_V3_TEMPLATE),
    Family("llama3_2", functools.partial(_is_llama3, dated=True), LLAMA3_2_TEMPLATE),
    Family("llama3_1", functools.partial(_is_llama3, dated=False), LLAMA3_1_TEMPLATE),
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
    if not agentic:
        return None
    if not template_preserves_prefix(tokenizer, chat_template_kwargs):
        why = "is not prefix-preserving for tool turns"
    elif not renders_several_calls(tokenizer, chat_template_kwargs):
        why = "cannot render a turn of several tool calls"
    else:
        return None
    family = detect_family(tokenizer)
    if family is None:
        return None
    tokenizer.chat_template = family.template
    log.info("chat template of %s %s: using asyncrl's training-safe %s template, saved with the checkpoints too "
             "(rollout.chat_template=auto; keep disables it)", model, why, family.name)  # fmt: skip
    return family.name


def renders_several_calls(tokenizer: Any, chat_template_kwargs: dict[str, Any]) -> bool:
    """Whether the chat template renders an assistant turn of two tool calls, as a rollout's next turn renders one
    the model wrote. Llama 3.1 to 3.3's stock templates raise ("This model only supports single tool-calls at
    once!"), which would end that rollout mid-run."""
    call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call, call]}]
    try:
        tokenizer.apply_chat_template(turns, tokenize=False, **chat_template_kwargs)
    except Exception:
        return False
    return True


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
