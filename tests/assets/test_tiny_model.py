from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.assets import asset_path
from asyncrl.assets.arithmetic import is_correct, read_rows
from asyncrl.assets.tiny_model import BOXED, CHARS, EOS, ROLE_TOKENS, build_model, build_tokenizer

MAX_WEIGHT_BYTES = 15_000_000
CONVERSATION = [
    {"role": "system", "content": "Answer in \\boxed{}."},
    {"role": "user", "content": "What is 37 + 48?"},
    {"role": "assistant", "content": "37+48=\\boxed{85}"},
    {"role": "tool", "content": "ok\n"},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "\\boxed{2}"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    path = asset_path("tiny-arith")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@given(st.lists(st.sampled_from(CHARS + ROLE_TOKENS + (EOS, BOXED)), max_size=60).map("".join))
def test_tokenizer_round_trips_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_each_character_is_one_token(tokenizer):
    ids = tokenizer.encode("What is 37 + 48?\n", add_special_tokens=False)
    assert len(ids) == len("What is 37 + 48?\n")
    assert tokenizer.encode("\\boxed{85}", add_special_tokens=False) == tokenizer.convert_tokens_to_ids(
        [BOXED, "8", "5", "}"]
    )


def test_unknown_character_encodes_as_unk(tokenizer):
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]


@pytest.mark.parametrize("k", range(1, len(CONVERSATION) + 1))
def test_chat_template_is_prefix_preserving(tokenizer, k):
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert full.startswith(tokenizer.apply_chat_template(CONVERSATION[:k], tokenize=False))
    full_ids = tokenizer.apply_chat_template(CONVERSATION, return_dict=False)
    prefix_ids = tokenizer.apply_chat_template(CONVERSATION[:k], return_dict=False)
    assert full_ids[: len(prefix_ids)] == prefix_ids
    if k < len(CONVERSATION) and CONVERSATION[k]["role"] == "assistant":
        prompt = tokenizer.apply_chat_template(CONVERSATION[:k], tokenize=False, add_generation_prompt=True)
        assert full.startswith(prompt)


def test_generation_prompt_then_answer_renders_the_turn(tokenizer):
    prompt = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>What is 37 + 48?<|end|><|assistant|>"


def test_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(TemplateError, match="unknown role bot"):
        tokenizer.apply_chat_template([{"role": "bot", "content": "hi"}], tokenize=False)


def test_build_model_is_seeded(tokenizer):
    first, again, other = (build_model(tokenizer, seed).state_dict() for seed in (0, 0, 1))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first[name], other[name])


def test_shipped_asset_loads_like_a_hub_model(shipped, tokenizer):
    model, shipped_tokenizer = shipped
    config = model.config
    assert (config.model_type, config.head_dim, config.max_position_embeddings) == ("qwen3", 64, 256)
    assert config.vocab_size == len(shipped_tokenizer)
    assert shipped_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert shipped_tokenizer.chat_template == tokenizer.chat_template
    assert model.generation_config.eos_token_id == shipped_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == shipped_tokenizer.pad_token_id
    assert model.dtype == torch.float32


def test_shipped_weights_fit_in_git():
    assert (asset_path("tiny-arith") / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES


def test_shipped_model_is_right_greedily_and_unsure_at_temperature_1(shipped):
    # Pretraining taught the sums but spread ~65% of the answer mass over wrong last digits:
    # greedy decoding is right, sampling at temperature 1 only sometimes (pretrain.json: 1.000 and 0.348).
    model, tokenizer = shipped
    rows = read_rows(asset_path("arith") / "eval.jsonl")[:32]
    torch.manual_seed(0)
    greedy, sampled = 0, 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
        input_ids = torch.tensor([prompt])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=8)
        greedy += is_correct(tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True), row["solution"])
        input_ids = input_ids.repeat(8, 1)
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 8}
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **sampling)
        texts = tokenizer.batch_decode(out[:, len(prompt) :], skip_special_tokens=True)
        sampled += sum(is_correct(text, row["solution"]) for text in texts)
    assert greedy == len(rows)
    assert 0.2 <= sampled / (8 * len(rows)) <= 0.5
