"""Image prompts on the built-in server: OpenAI/vLLM image content parts in, what a prefill needs out.

The chat route hands ``split_images`` the request's messages; a message whose content lists image parts keeps them
(as ``{"type": "image"}``) for the chat template, which renders one image placeholder per image. ``ImagePrompts``
then does what Qwen's processor does for images (transformers builds that processor only with torchvision, for its
video half): the image processor's pixel values and patch grids, each placeholder repeated once per merged patch.
It also asks the model's own ``get_rope_index`` for the prompt's M-RoPE positions: an image's tokens share positions
laid out over its grid, so the text after it sits at its token index plus a constant ``rope_delta``, which decoding
adds from then on. Images come as base64 ``data:`` URLs only: the server fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.model_kind import is_vision_language
from asyncrl.rollout.types import PromptImages

logger = logging.getLogger(__name__)

IMAGE_PART_TYPES = ("image_url", "image")
"""OpenAI's and vLLM's image part (``image_url.url``), and Hugging Face chat messages' (``image`` or ``url``)."""
NO_IMAGES = "messages: image content parts, but the served model has no vision tower: it serves text only"


@dataclass(frozen=True, eq=False)
class ImageInputs(PromptImages):
    """A prompt's images (the image processor's patches and grids) as its prefill takes them. Compared by identity:
    the children of an ``n > 1`` request share one, and rows with the same tokens are prefilled once only when they
    share it too."""

    token_indices: torch.Tensor
    """Where in the prompt the image tokens are, which the vision tower's features replace."""
    prompt_positions: torch.Tensor
    """The prompt's M-RoPE positions (time, height, width): [3, prompt length]."""
    rope_delta: int
    """A text token's M-RoPE position minus its index, for every token after the prompt."""

    def positions(self, length: int) -> torch.Tensor:
        """M-RoPE positions [3, length] of the prompt and the tokens generated after it."""
        generated = torch.arange(self.prompt_positions.shape[1], length) + self.rope_delta
        return torch.cat([self.prompt_positions, generated.expand(3, -1)], dim=1)


@dataclass(frozen=True)
class ImagePrompts:
    """What turns a rendered prompt and its images into ``ImageInputs``, for one served model."""

    image_processor: Any
    image_token_id: int
    rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """The model's ``get_rope_index(input_ids, mm_token_type_ids=, image_grid_thw=)``: positions and rope deltas."""

    def inputs(self, prompt: list[int], parts: list[dict[str, Any]]) -> tuple[list[int], ImageInputs]:
        """The prompt with each image placeholder expanded to one per merged patch, and its images' inputs."""
        images = [decode_data_url(image_url(part)) for part in parts]
        placeholders = prompt.count(self.image_token_id)
        if placeholders != len(images):
            raise ValueError(f"messages: the chat template rendered {placeholders} image placeholders for "
                             f"{len(images)} images")  # fmt: skip
        processed = self.image_processor(images=images, return_tensors="pt")
        patches = PromptImages(processed["pixel_values"], processed["image_grid_thw"], self.image_token_id,
                               self.image_processor.merge_size)  # fmt: skip
        ids = patches.expand(prompt)
        is_image = torch.tensor([ids]) == self.image_token_id
        positions, deltas = self.rope_index(torch.tensor([ids]), mm_token_type_ids=is_image.int(),
                                            image_grid_thw=patches.image_grid_thw)  # fmt: skip
        inputs = ImageInputs(**vars(patches), token_indices=is_image[0].nonzero().squeeze(1),
                             prompt_positions=positions[:, 0], rope_delta=int(deltas.reshape(-1)[0]))  # fmt: skip
        return ids, inputs


def load_image_prompts(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: str,
                       trust_remote_code: bool) -> ImagePrompts | None:  # fmt: skip
    """The served model's image prompts; None for a text-only model, and for a vision-language checkpoint without
    an M-RoPE model, an image token in its tokenizer or an image processor (logged: it serves text only)."""
    if not is_vision_language(model.config):
        return None
    rope_index = next((module.get_rope_index for module in model.modules() if hasattr(module, "get_rope_index")), None)
    image_token_id = getattr(model.config, "image_token_id", None)
    if rope_index is None or image_token_id is None or image_token_id >= len(tokenizer):
        logger.warning("%s: no M-RoPE model or no image token in its tokenizer: serving text only", path)
        return None
    from transformers import AutoImageProcessor

    try:
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ImportError) as error:  # none saved, or one that needs torchvision where it is not installed
        logger.warning("%s: no image processor (%s): serving text only", path, str(error).strip().splitlines()[0])
        return None
    return ImagePrompts(image_processor, image_token_id, rope_index)


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages as the chat template takes them, and their image parts in order. Content without images is a
    string (text parts joined by newlines: vLLM's "string" format); content with images stays a list of parts."""
    rendered, images = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = [_part(part) for part in content]
            images += [part for part in content if part.get("type") in IMAGE_PART_TYPES]
            if all(part["type"] == "text" for part in parts):
                content = "\n".join(part["text"] for part in parts)
            else:
                content = parts
        rendered.append({**message, "content": content})
    return rendered, images


def _part(part: Any) -> dict[str, Any]:
    """A content part for the chat template: text as it is, an image as ``{"type": "image"}``; any other is a 400."""
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind in IMAGE_PART_TYPES:
        return {"type": "image"}
    if kind != "text":
        raise ValueError(f"messages: a content part of type {kind!r}: the built-in server serves text and images only")
    return part


def image_url(part: dict[str, Any]) -> str:
    """The URL an image part carries: ``image_url.url`` (OpenAI), or ``image`` or ``url`` (Hugging Face)."""
    url = part.get("image", part.get("url"))
    if part["type"] == "image_url":
        url = part["image_url"].get("url") if isinstance(part.get("image_url"), dict) else None
    if not isinstance(url, str):
        where = "image_url.url" if part["type"] == "image_url" else "image (or url)"
        raise ValueError(f"messages: an {part['type']} content part needs {where}: a data:image/...;base64 URL")
    return url


def decode_data_url(url: str) -> Any:
    """The RGB image of a base64 ``data:`` URL."""
    from PIL import Image, UnidentifiedImageError

    header, _, data = url.partition(",")
    if not (header.startswith("data:") and header.endswith(";base64")):
        raise ValueError(f"messages: image URL {url[:40]!r}...: the built-in server takes images as base64 data: URLs "
                         "only (it fetches nothing)")  # fmt: skip
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB")
    except (binascii.Error, UnidentifiedImageError) as error:
        raise ValueError(f"messages: an image data: URL that is not a base64 image ({error})") from error
