"""A tiny random Qwen3 with a word-level tokenizer, built deterministically for the server tests.

The embeddings are tied and larger than the default init, so the untrained model mostly repeats its last
token: after an EOS it says EOS again (a deterministic "stop"), elsewhere its distribution is still spread
enough for top-k, top-p and seeds to matter.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB_SIZE = 96
EOS_ID = 1
MAX_MODEL_LEN = 512
SERVED_NAME = "tiny-qwen3"


def build_tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).eval()
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 0.1)
    return model


def build_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz", *"0123456789"]
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    backend = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
