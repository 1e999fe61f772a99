"""Chat-template swap: a Qwen3-like tokenizer whose stock template drops earlier reasoning gets the training-safe
template (auto), keeps its own (keep) or takes a file (path); unknown families only warn."""

from __future__ import annotations

import json
import logging
import pickle
import warnings

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncrl.config.schema import Config
from asyncrl.rollout.templates import QWEN3_TEMPLATE, detect_family, use_chat_template
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
