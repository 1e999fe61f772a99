"""A rollout's prompt tokens: a conversation through the chat template, a plain-text prompt as TRL tokenizes it."""

from __future__ import annotations

from tokenizers import Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

from asyncrl.prompts import render_prompt


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
