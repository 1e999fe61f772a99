"""Tiny random checkpoints of the model families asyncrl trains beyond dense Qwen3: a gated-DeltaNet hybrid
(Qwen3.5 text) and a Mixture-of-Experts model. The vision-language one (Qwen3.5 around this hybrid) is
``tiny_vlm``'s.

Tests and benchmarks build them from transformers' own config classes with the tiny-arith tokenizer, so
nothing is downloaded; ``save_checkpoint`` writes the `save_pretrained` layout a Hub checkpoint has (plus an
image-processor config for a vision-language model, which vLLM loads even to serve text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from asyncrl.assets.tiny_model import MAX_POSITIONS, build_generation_config, save_tiny_model

HYBRID_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
"""Qwen3.5's pattern: three gated-DeltaNet layers for each full-attention layer."""


def hybrid_text_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> PretrainedConfig:
    """A Qwen3.5 text model: 3 gated-DeltaNet + 1 attention layer, grouped value heads (4 value heads read 2
    key heads), head_dim 64 for the attention layer (vLLM's kernels take it)."""
    from transformers import Qwen3_5TextConfig

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=HYBRID_LAYERS, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def moe_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> PretrainedConfig:
    """A Qwen3-MoE model: 2 layers of 4 experts, 2 routed per token, load-balancing coefficient 0.01."""
    from transformers import Qwen3MoeConfig

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.01, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def build_model(config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> torch.nn.Module:
    """Random float32 weights from ``config`` (a vision-language config builds the image-text-to-text class)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    model.generation_config = build_generation_config(tokenizer)
    return model


def save_checkpoint(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """`save_pretrained` layout; a vision-language model also gets the image-processor config vLLM loads."""
    out = Path(out_dir)
    save_tiny_model(model, tokenizer, out)
    if hasattr(model.config, "vision_config"):
        image_processor_class()(patch_size=model.config.vision_config.patch_size).save_pretrained(out)
    return out


def image_processor_class() -> type:
    """Qwen2-VL's image processor: the torchvision one where torchvision is installed (as on a GPU machine, whose
    vLLM loads it), else its PIL twin, named outright: transformers >= 5.24 falls back to it by itself only when
    the torchvision module was not imported first, so which one a process got depended on import order."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil
