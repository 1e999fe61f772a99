"""Builds the tiny character-level tokenizer and the random-init Qwen3 model behind the `tiny-arith` asset.

The layout `save_tiny_model` writes is plain `save_pretrained`, so code that loads `Qwen/...` loads this
too. `asyncrl.assets.pretrain` trains the model; tests build the tokenizer directly.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

PAD, EOS, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
# One token for the answer wrapper: RL generates `\boxed{` + digits + `}` + EOS, 5 tokens instead of 11.
BOXED = "\\boxed{"
# Printable ASCII plus tab and newline; anything else encodes as UNK.
CHARS = tuple(c for c in string.printable if c not in "\r\x0b\x0c")
MAX_POSITIONS = 256

# Each turn is `<|role|>content<|end|>` with no separators, so rendering messages[:k] is a prefix of
# rendering messages, and the generation prompt `<|assistant|>` is a prefix of the next assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('tiny-arith chat template: unknown role ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: a BPE model with no merges splits text into single characters."""
    specials = (PAD, EOS, UNK, *ROLE_TOKENS)
    vocab = {token: i for i, token in enumerate((*specials, *CHARS, BOXED))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(BOXED, special=False, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def build_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """Qwen3 with head_dim 64, which vLLM's and FlashAttention's kernels accept; ~3.2M parameters."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Stop on `<|end|>` and pad with `<|pad|>` in `generate` and in vLLM alike."""
    return GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    """Random-init float32 model; initialised on CPU so the weights depend on `seed` alone, not the device."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(build_config(tokenizer)).float()
    model.generation_config = build_generation_config(tokenizer)
    return model


def save_tiny_model(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write model, tokenizer and generation config in `save_pretrained` layout."""
    out = Path(out_dir)
    model.to("cpu").save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Name the class every transformers version knows, not this version's internal backend class.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
