"""A rollout's prompt tokens: a conversation through the chat template, a plain-text prompt as TRL tokenizes it; the
longest prompt of the training data, which sizes vLLM's context."""

from __future__ import annotations

from tokenizers import Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

from asyncrl.config.compose import compose, to_config
from asyncrl.data import load_prompts
from asyncrl.prompts import load_tokenizer, longest_prompt_tokens, render_prompt


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer whose post-processor opens every text with <bos>, as Gemma's and Llama's do."""
    vocab = {token: i for i, token in enumerate(["<bos>", "<eos>", *"0123456789 +=?abcdefghijklmnopqrstuvwxyz"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")


def test_a_plain_text_prompt_gets_the_tokenizers_bos_as_trls_grpo_trainer_gives_it():
    tokenizer = bos_tokenizer()
    ids = render_prompt(tokenizer, "what is 1 + 2?", {})
    assert ids == [tokenizer.bos_token_id, *tokenizer("what is 1 + 2?", add_special_tokens=False)["input_ids"]]


def test_the_longest_prompt_is_measured_through_the_chat_template(arithmetic_data_dir, random_tiny_model_dir):
    data = arithmetic_data_dir / "train.jsonl"
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", f"data.path={data}"]))
    tokenizer = load_tokenizer(config)
    rendered = [tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True)
                for p in load_prompts(str(data))["prompt"]]  # fmt: skip
    longest = max(len(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in rendered)
    assert longest_prompt_tokens(config) == longest
    config.data.max_prompt_length = 7  # given: nothing is measured
    assert longest_prompt_tokens(config) == 7
