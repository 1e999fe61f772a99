"""Builds a tiny random Qwen3.5 vision-language checkpoint that takes images, for tests and CPU runs.

``save_tiny_vlm(folder, seed)`` writes, in `save_pretrained` layout, a ``Qwen3_5ForConditionalGeneration`` (the
gated-DeltaNet hybrid text model of ``model_families`` and a one-block vision tower of 8-pixel patches, so a 32x32
image is 4 merged patches and the largest, 64x64, is 16), the tiny-arith character tokenizer plus Qwen's vision
tokens, a chat template that renders image content parts, Qwen2-VL's image processor and a ``processor_config.json``
naming Qwen3VLProcessor, so ``AutoProcessor.from_pretrained`` loads it where torchvision is installed (transformers
builds Qwen's processor only with its video processor, which needs torchvision). About 3 MB, built in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from asyncrl.assets.model_families import build_model, hybrid_text_config, image_processor_class
from asyncrl.assets.tiny_model import build_tokenizer, save_tiny_model

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
"""Qwen's vision tokens. No video is served, but Qwen's processor marks its video token's id in every prompt: without
``<|video_pad|>`` in the vocabulary that id would be the unknown token's."""
PATCH_SIZE = 8
MERGE_SIZE = 2
MIN_PIXELS = 32 * 32
"""Smaller images are resized up to it: 4 merged patches at least."""
MAX_PIXELS = 64 * 64
"""Larger images are resized down to it: 16 merged patches at most."""

# tiny-arith's template, with content either a string (rendered as tiny-arith renders it) or a list of parts: text
# parts as their text, each image part as Qwen's placeholder, which the processor expands to one pad per patch.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('tiny-vlm chat template: unknown role ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}"
    f"{{{{- '{VISION_START}{IMAGE_PAD}{VISION_END}' -}}}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- else -%}{{- raise_exception('tiny-vlm chat template: unknown content part ' ~ part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """tiny-arith's character tokenizer plus the vision tokens (ids after its own), with the image-aware template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_vlm_config(tokenizer: PreTrainedTokenizerFast, **text_overrides: Any) -> PretrainedConfig:
    """Qwen3.5 around ``model_families``' hybrid text model (``text_overrides`` change it: tests and benchmarks
    build other shapes from it), its vision token ids those of ``tokenizer``. The embeddings are untied unless
    overridden: with tied ones the random model repeats its last token whatever the image, and greedy generations
    could not tell images apart."""
    from transformers import Qwen3_5Config

    text = hybrid_text_config(tokenizer, **{"tie_word_embeddings": False, **text_overrides})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.hidden_size,
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, num_position_embeddings=64)  # fmt: skip
    token_id = tokenizer.convert_tokens_to_ids
    return Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=vision,
        tie_word_embeddings=text.tie_word_embeddings,
        vision_start_token_id=token_id(VISION_START),
        image_token_id=token_id(IMAGE_PAD),
        vision_end_token_id=token_id(VISION_END),
        video_token_id=token_id(VIDEO_PAD),
    )


def save_tiny_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the random-init float32 checkpoint (weights from ``seed`` alone), tokenizer, image processor and
    processor config into ``out_dir``; returns it."""
    tokenizer = build_vlm_tokenizer()
    with torch.random.fork_rng():
        model = build_model(build_vlm_config(tokenizer), tokenizer, seed=seed)
    out = Path(out_dir)
    save_tiny_model(model, tokenizer, out)
    image_processor = image_processor_class()(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    )
    image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")
    return out
