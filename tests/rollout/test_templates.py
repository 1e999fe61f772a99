"""Chat-template swap: a Qwen3-like tokenizer whose stock template drops earlier reasoning gets the training-safe
template (auto), keeps its own (keep) or takes a file (path); unknown families only warn. DeepSeek's and Llama 3's
training-safe templates (Llama's golden against Meta's stock one where that renders, one call a turn)."""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config
from asyncrl.rollout.templates import (
    LLAMA3_1_TEMPLATE,
    LLAMA3_2_TEMPLATE,
    QWEN3_TEMPLATE,
    detect_family,
    renders_several_calls,
    use_chat_template,
)
from asyncrl.rollout.tools import assistant_message, detect_format, parse_tool_calls, template_preserves_prefix
from asyncrl.trainer.setup import check_agents

QWEN_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Like Qwen3's stock template: earlier assistant turns lose their reasoning, the last one gets an empty one.
STOCK_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if not loop.last -%}{%- set c = m.content.split('</think>')[-1].lstrip() -%}"
    "{%- elif '<think>' in m.content -%}{%- set c = m.content -%}"
    "{%- else -%}{%- set c = '<think>\\n\\n</think>\\n\\n' + m.content -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + c -}}"
    "{%- for call in m.tool_calls or [] -%}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' -}}'
    "{{- call.function.arguments | tojson + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
ENV = "asyncrl.environments.counter:IncrementEnv"


def build_tokenizer(special: tuple[str, ...] = ("<|im_start|>", "<|im_end|>"), added: tuple[str, ...] = QWEN_TOKENS,
                    template: str = STOCK_LIKE) -> PreTrainedTokenizerFast:  # fmt: skip
    """A word-level tokenizer carrying a family's special tokens and markers, built locally (no Hub)."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token=special[-1])
    tokenizer.add_tokens(list(added))
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.chat_template = template
    return tokenizer


def agent_config(chat_template: str) -> Config:
    config = Config()
    config.model.name_or_path = "local/qwen3-like"
    config.rollout.environment_factory = ENV
    config.rollout.chat_template = chat_template
    return config


def call(name: str, **arguments: int) -> str:
    """A call as Qwen3 emits it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_loop_prompts(tokenizer: PreTrainedTokenizerFast, thinking: bool) -> list[tuple[str, str]]:
    """(text held after a turn, the next turn's rendered prompt) for: reasoning + 2 tool calls, results, answer."""
    kwargs = {} if thinking else {"enable_thinking": False}
    think = "<think>\nI should add both.\n</think>\n\n" if thinking else ""
    replies = [f"{think}Adding.\n{call('add', a=1, b=2)}\n{call('add', a=3, b=4)}", f"{think}3 and 7."]
    messages = [{"role": "user", "content": "1+2 and 3+4?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    pairs = []
    for reply, follow_up in zip(replies, ([("add", "3"), ("add", "7")], [("user", "Thanks.")]), strict=True):
        held = prompt + reply + "<|im_end|>"
        content, calls = parse_tool_calls(reply, "hermes")
        messages.append(assistant_message(content, calls) if calls else {"role": "assistant", "content": reply})
        if calls:
            messages += [{"role": "tool", "name": name, "content": result} for name, result in follow_up]
        else:
            messages += [{"role": role, "content": text} for role, text in follow_up]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        pairs.append((held, prompt))
    return pairs


@pytest.mark.parametrize("thinking", [True, False])
def test_swap_makes_the_tool_loop_prefix_preserving(thinking):
    tokenizer = build_tokenizer()
    kwargs = {} if thinking else {"enable_thinking": False}
    assert detect_family(tokenizer).name == "qwen3"
    assert not template_preserves_prefix(tokenizer, kwargs)
    assert not all(prompt.startswith(held) for held, prompt in tool_loop_prompts(tokenizer, thinking))
    assert use_chat_template(tokenizer, "auto", agentic=True, chat_template_kwargs=kwargs, model="m") == "qwen3"
    assert tokenizer.chat_template == QWEN3_TEMPLATE and template_preserves_prefix(tokenizer, kwargs)
    for held, prompt in tool_loop_prompts(tokenizer, thinking):
        assert prompt.startswith(held)


def test_swapped_tool_calls_parse_back_in_the_hermes_format():
    tokenizer = build_tokenizer(template=QWEN3_TEMPLATE)
    held, prompt = tool_loop_prompts(tokenizer, thinking=True)[0]
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn, detect_format(tokenizer.chat_template))
    assert content == "<think>\nI should add both.\n</think>\n\nAdding."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                               ("add", {"a": 3, "b": 4}, None)]  # fmt: skip
    assert prompt.count("<tool_response>") == 2 and prompt.count("<|im_start|>user") == 2


def test_tools_schema_goes_into_the_system_turn():
    tokenizer = build_tokenizer(template=QWEN3_TEMPLATE)
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "add"' in system
    assert "<tools>\n" in system and text.count("<|im_start|>system") == 1


def test_auto_swap_travels_to_the_worker_and_the_saved_model(tmp_path, caplog):
    tokenizer = build_tokenizer()
    with caplog.at_level(logging.INFO, logger="asyncrl.rollout.templates"), warnings.catch_warnings():
        warnings.simplefilter("error")
        check_agents(agent_config("auto"), tokenizer)
    assert "training-safe qwen3" in caplog.text
    assert pickle.loads(pickle.dumps(tokenizer)).chat_template == QWEN3_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == QWEN3_TEMPLATE


def test_auto_without_tools_or_environments_keeps_the_stock_template():
    tokenizer = build_tokenizer()
    assert use_chat_template(tokenizer, "auto", agentic=False, chat_template_kwargs={}, model="m") is None
    assert tokenizer.chat_template == STOCK_LIKE


def test_keep_warns_and_leaves_the_template():
    tokenizer = build_tokenizer()
    with pytest.warns(UserWarning, match="re-renders earlier turns"):
        check_agents(agent_config("keep"), tokenizer)
    assert tokenizer.chat_template == STOCK_LIKE


def test_a_template_file_is_used(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text(QWEN3_TEMPLATE.replace("asyncrl training-safe", "my own"))
    tokenizer = build_tokenizer(special=("<|user|>", "<|end|>"), added=())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_agents(agent_config(str(path)), tokenizer)
    assert tokenizer.chat_template == path.read_text()
    with pytest.raises(FileNotFoundError, match="rollout.chat_template='missing.jinja'"):
        check_agents(agent_config("missing.jinja"), tokenizer)


def test_unknown_family_warns_without_swapping():
    template = STOCK_LIKE.replace("<|im_start|>", "<|").replace("<|im_end|>", "<|end|>")
    tokenizer = build_tokenizer(special=("<|user|>", "<|end|>"), added=("<tool_call>",), template=template)
    assert detect_family(tokenizer) is None
    with pytest.warns(UserWarning, match="rollout.chat_template=auto swaps one in"):
        check_agents(agent_config("auto"), tokenizer)
    assert tokenizer.chat_template == template


FIXTURES = Path(__file__).parent / "fixtures"
DEEPSEEK_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁calls▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>")  # fmt: skip
DEEPSEEK_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
# DeepSeek-V3's own generation prompt has no <think> (R1's, the fixture's, opens one); otherwise the same template.
DEEPSEEK_R1_STOCK = (FIXTURES / "deepseek_v3.jinja").read_text()
DEEPSEEK_V3_STOCK = DEEPSEEK_R1_STOCK.replace("<｜Assistant｜><think>\\n", "<｜Assistant｜>")


@pytest.mark.parametrize(
    "fixture, preserves", [("llama3_2.jinja", True), ("glm4_5.jinja", True), ("functiongemma.jinja", True),
                           ("gemma4.jinja", True), ("deepseek_v3.jinja", False)],
)  # fmt: skip
def test_family_templates_on_the_tool_round_prefix_check(fixture, preserves):
    """The published templates as they are: DeepSeek's concatenates the arguments as text, so the object the
    parser yields crashes it (asyncrl swaps its own in, below); the others keep the tool round's prefix."""
    tokenizer = build_tokenizer(special=("<s>",), added=(), template=(FIXTURES / fixture).read_text())
    assert template_preserves_prefix(tokenizer, {}) is preserves


def deepseek_calls(*pairs: tuple[int, int]) -> str:
    """Calls as DeepSeek-V3 and R1 emit them."""
    body = "\n".join("<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n" + json.dumps({"a": a, "b": b})
                     + "\n```<｜tool▁call▁end｜>" for a, b in pairs)  # fmt: skip
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def replay_tool_loop(tokenizer: PreTrainedTokenizerFast, replies: list[str], fmt: str, end: str,
                     **kwargs: object) -> list[tuple[str, str]]:  # fmt: skip
    """(text held after each reply, the next turn's rendered prompt) for a rollout of ``replies`` to "1+2 and 3+4, then
    their sum?" whose turns end with ``end``: each add(a, b) call the reply makes (parsed in ``fmt``) gets a + b as
    its result, a reply without calls a user's "Thanks."."""
    render = {"tokenize": False, "add_generation_prompt": True, **kwargs}
    messages = [{"role": "user", "content": "1+2 and 3+4, then their sum?"}]
    prompt, pairs = tokenizer.apply_chat_template(messages, **render), []
    for reply in replies:
        held = prompt + reply + end
        content, calls = parse_tool_calls(reply, fmt)
        messages.append(assistant_message(content, calls) if calls else {"role": "assistant", "content": reply})
        messages += [{"role": "tool", "name": "add", "content": str(c.arguments["a"] + c.arguments["b"])}
                     for c in calls] or [{"role": "user", "content": "Thanks."}]  # fmt: skip
        prompt = tokenizer.apply_chat_template(messages, **render)
        pairs.append((held, prompt))
    return pairs


def deepseek_loop_prompts(tokenizer: PreTrainedTokenizerFast, think: bool) -> list[tuple[str, str]]:
    """The tool loop of (reasoning +) 2 calls, 1 more call right after their results, the answer."""
    reasoning = "I should add both.\n</think>\n\n" if think else ""
    replies = [f"{reasoning}Adding.{deepseek_calls((1, 2), (3, 4))}", f"Now the sum.{deepseek_calls((3, 7))}", "10."]
    return replay_tool_loop(tokenizer, replies, "deepseek_v3", "<｜end▁of▁sentence｜>")


@pytest.mark.parametrize(
    "stock, family, think",
    [(DEEPSEEK_R1_STOCK, "deepseek_r1", True), (DEEPSEEK_V3_STOCK, "deepseek_v3", False)],
    ids=["r1", "v3"],
)
def test_deepseek_swap_keeps_every_tool_round_prefix_preserving(stock, family, think):
    tokenizer = build_tokenizer(special=DEEPSEEK_SPECIAL, added=DEEPSEEK_TOKENS, template=stock)
    assert detect_family(tokenizer).name == family and detect_format(stock) == "deepseek_v3"
    assert use_chat_template(tokenizer, "auto", agentic=True, chat_template_kwargs={}, model="m") == family
    assert template_preserves_prefix(tokenizer, {}) and detect_format(tokenizer.chat_template) == "deepseek_v3"
    for held, prompt in deepseek_loop_prompts(tokenizer, think):
        assert prompt.startswith(held)
    assert prompt.endswith("<｜User｜>Thanks.<｜Assistant｜>" + ("<think>\n" if think else ""))
    assert prompt.count("<｜tool▁outputs▁begin｜>") == prompt.count("<｜tool▁outputs▁end｜>") == 2


def test_stock_deepseek_kept_with_tools_is_refused_in_one_line():
    """keep leaves DeepSeek's stock template, which cannot render the calls the loop appends: refused at startup,
    not at the second turn of the first rollout."""
    tokenizer = build_tokenizer(special=DEEPSEEK_SPECIAL, added=DEEPSEEK_TOKENS,
                                template=DEEPSEEK_R1_STOCK)  # fmt: skip
    with pytest.raises(ConfigError, match="cannot render a tool call and its result") as error:
        check_agents(agent_config("keep"), tokenizer)
    assert "rollout.chat_template=auto" in str(error.value) and "\n" not in str(error.value)


def test_a_template_without_a_tool_role_is_refused_under_auto():
    """Like Gemma 3's stock template: roles must alternate user/assistant, so a tool result raises."""
    template = ("{%- for m in messages -%}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                "{%- endif -%}{{ '<start_of_turn>' + m.role + '\\n' + m.content + '<end_of_turn>\\n' }}"
                "{%- endfor -%}")  # fmt: skip
    tokenizer = build_tokenizer(special=("<start_of_turn>", "<end_of_turn>"), added=(), template=template)
    with pytest.raises(ConfigError, match="Conversation roles must alternate"):
        check_agents(agent_config("auto"), tokenizer)


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_STOCK = (FIXTURES / "llama3_2.jinja").read_text()
ADD_SCHEMA = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}  # fmt: skip


def llama3_tokenizer(template: str) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(special=LLAMA3_SPECIAL, added=(), template=template)
    tokenizer.bos_token = "<|begin_of_text|>"
    return tokenizer


def add_call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}


SINGLE_CALL_CONVERSATIONS = {
    "system, call, result, answer, user": [
        {"role": "system", "content": " Be brief. "}, {"role": "user", "content": "1+2? "},
        {"role": "assistant", "content": "", "tool_calls": [add_call(1, 2)]},
        {"role": "tool", "name": "add", "content": "3"}, {"role": "assistant", "content": "It is 3."},
        {"role": "user", "content": "Thanks."}],
    "content beside the call, an object result": [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [add_call(1, 2)]},
        {"role": "tool", "name": "add", "content": {"sum": 3}}],
    "plain chat": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}],
}  # fmt: skip


@pytest.mark.parametrize("conversation", SINGLE_CALL_CONVERSATIONS.values(), ids=SINGLE_CALL_CONVERSATIONS)
@pytest.mark.parametrize("options", [{"tools": [ADD_SCHEMA]}, {"tools": [ADD_SCHEMA], "tools_in_user_message": False},
                                     {}], ids=["tools-in-user-turn", "tools-in-system-turn", "no-tools"])  # fmt: skip
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_llama3_training_template_renders_one_call_a_turn_as_the_stock_one(conversation, options, generation_prompt):
    """Golden: where Meta's Llama 3.2 template renders at all (one call a turn), asyncrl's renders the same text."""
    kwargs = {"tokenize": False, "add_generation_prompt": generation_prompt, "date_string": "26 Jul 2024", **options}
    stock = llama3_tokenizer(LLAMA3_STOCK).apply_chat_template(conversation, **kwargs)
    assert llama3_tokenizer(LLAMA3_2_TEMPLATE).apply_chat_template(conversation, **kwargs) == stock


def test_llama3_training_templates_keep_each_versions_date():
    """3.2's stock template dates the system turn today, 3.1's and 3.3's with a fixed date: each swap keeps its own."""
    messages = [{"role": "user", "content": "Hi."}]
    rendered = llama3_tokenizer(LLAMA3_1_TEMPLATE).apply_chat_template(messages, tokenize=False)
    assert "Today Date: 26 Jul 2024\n" in rendered
    stock_31 = LLAMA3_STOCK.replace('strftime_now("%d %b %Y")', '"26 Jul 2024"').replace("strftime_now", "no_clock")
    assert detect_family(llama3_tokenizer(stock_31)).name == "llama3_1"
    assert detect_family(llama3_tokenizer(LLAMA3_STOCK)).name == "llama3_2"


def llama3_loop_prompts(tokenizer: PreTrainedTokenizerFast) -> list[tuple[str, str]]:
    """The tool loop of two calls in one turn, one more call, the answer (ending in a newline)."""
    replies = ['{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
               '{"name": "add", "parameters": {"a": 3, "b": 7}}', "The sums are 3 and 7, then 10.\n"]  # fmt: skip
    return replay_tool_loop(tokenizer, replies, "llama3", "<|eot_id|>", tools=[ADD_SCHEMA], date_string="26 Jul 2024")


def test_llama3_swap_renders_several_calls_a_turn_prefix_preserving():
    """Meta's template raises on a turn of two calls (which ended the rollout's next render); auto swaps in asyncrl's,
    whose renders keep every turn's tokens and whose calls parse back in the llama3 format."""
    tokenizer = llama3_tokenizer(LLAMA3_STOCK)
    assert template_preserves_prefix(tokenizer, {}) and not renders_several_calls(tokenizer, {})
    with pytest.raises(Exception, match="only supports single tool-calls"):
        llama3_loop_prompts(tokenizer)
    assert use_chat_template(tokenizer, "auto", agentic=True, chat_template_kwargs={}, model="m") == "llama3_2"
    assert tokenizer.chat_template == LLAMA3_2_TEMPLATE and detect_format(tokenizer.chat_template) == "llama3"
    assert renders_several_calls(tokenizer, {})
    pairs = llama3_loop_prompts(tokenizer)
    for held, prompt in pairs:
        assert prompt.startswith(held)
    first_turn = pairs[0][0].split("<|start_header_id|>assistant<|end_header_id|>\n\n")[-1].removesuffix("<|eot_id|>")
    assert [(c.name, c.arguments) for c in parse_tool_calls(first_turn, "llama3")[1]] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]  # fmt: skip
    assert prompt.count("<|start_header_id|>ipython<|end_header_id|>") == 3


def test_auto_keeps_a_template_that_renders_several_calls_prefix_preserving():
    """The training-safe template itself, met again (a checkpoint that saved it): nothing to swap."""
    tokenizer = llama3_tokenizer(LLAMA3_1_TEMPLATE)
    assert use_chat_template(tokenizer, "auto", agentic=True, chat_template_kwargs={}, model="m") is None
