"""Images in prompts: a dataset row's ``image`` / ``images`` column placed in its conversation, sent to the server and
handed to the trainer.

As TRL's GRPOTrainer does for vision-language datasets, a row's images go into its first user message as
``{"type": "image"}`` content parts before the text, here with the image itself under ``image`` (a PIL image), so
the messages carry them through the rollout loop. A turn with images goes to the server as chat messages with each
image a base64 PNG ``data:`` URL (``request_messages``): vLLM's tokens-in endpoint takes no images, so the server
renders the chat template and expands each image's placeholder to one token per merged patch, and answers the
prompt's token ids with the completion. The trainer's forward needs the same patches: ``ImageProcessing`` runs the
checkpoint's own image processor on the images (deterministic, so they are the patches the server's processor made)
and checks the server's placeholders against their grids.
"""

from __future__ import annotations

import base64
import io
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.data import IMAGE_COLUMNS
from asyncrl.prompts import Messages, RowTokens, render_prompt
from asyncrl.rollout.types import PromptImages

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

CACHED_PROMPTS = 256
"""Prompts whose images' request parts and patches are kept: a group's rollouts send the same images."""


def data_folder(path: str | None) -> Path | None:
    """The folder of a data file (data.path), from which its rows' relative image paths are read; None for a Hub
    dataset, a saved directory or no data (an environment's prompts)."""
    source = None if path is None else Path(path)
    return source.parent if source is not None and source.is_file() else None


def row_images(row: dict[str, Any], folder: Path | None = None) -> list[Any]:
    """The row's images as RGB PIL images: an ``images`` list or one ``image``; each a PIL image, datasets' Image
    value ({"bytes", "path"}), bytes, or a file path (relative ones from ``folder``, the data file's, first)."""
    values = next((row[column] for column in IMAGE_COLUMNS if row.get(column) is not None), None)
    if values is None:
        return []
    return [decode_image(value, folder) for value in (values if isinstance(values, list) else [values])]


def decode_image(value: Any, folder: Path | None = None) -> Any:
    """One image value as an RGB PIL image."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):  # datasets' Image feature, not decoded
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray):
        return Image.open(io.BytesIO(value)).convert("RGB")
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and folder is not None and (folder / path).exists():
            path = folder / path
        return Image.open(path).convert("RGB")
    raise ValueError(f"an image column value of type {type(value).__name__}: give a PIL image, bytes or a file path")


def with_images(messages: Messages, images: Sequence[Any]) -> Messages:
    """The conversation with ``images`` in its image parts: its bare ``{"type": "image"}`` placeholders filled in
    order, or, where it has none, new parts at the start of its first user message (TRL's placement)."""
    if not images:
        return messages
    bare = sum(1 for message in messages for part in _parts(message) if part.get("type") == "image")
    if bare and bare != len(images):
        raise ValueError(f"a prompt with {bare} image parts and {len(images)} images in its image column")
    remaining = iter(images)
    out = [dict(message) for message in messages]
    if bare:
        for message in out:
            if isinstance(message["content"], list):
                message["content"] = [{**part, "image": next(remaining)} if part.get("type") == "image" else part
                                      for part in message["content"]]  # fmt: skip
        return out
    first = next((message for message in out if message["role"] == "user"), None)
    if first is None:
        raise ValueError("a prompt with images has no user message to put them in")
    content = first["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    first["content"] = [*({"type": "image", "image": image} for image in remaining), *text]
    return out


def place_row_images(row: dict[str, Any], folder: Path | None) -> dict[str, Any]:
    """The row with its images decoded once into its prompt's image parts (its image column's, else those its image
    parts hold; a row without images as it is): a group's rollouts then share the image objects, whose request parts
    and patches are made once."""
    prompt = row.get("prompt")
    if not isinstance(prompt, list):
        return row
    images = row_images(row, folder)
    if images:
        return {**row, "prompt": with_images(prompt, images)}
    if not prompt_images(prompt):
        return row
    decoded = [
        {**m, "content": [{**p, "image": decode_image(p["image"], folder)} if p.get("type") == "image" else p
                          for p in m["content"]]} if isinstance(m["content"], list) else m
        for m in prompt
    ]  # fmt: skip
    return {**row, "prompt": decoded}


def prompt_images(messages: Messages | str) -> list[Any]:
    """The images of a conversation's image parts, in order."""
    if isinstance(messages, str):
        return []
    return [part["image"] for message in messages for part in _parts(message)
            if part.get("type") == "image" and part.get("image") is not None]  # fmt: skip


def request_messages(messages: Messages, urls: Sequence[str]) -> Messages:
    """The conversation as a chat request sends it: each image part an ``image_url`` of ``urls``, in order."""
    remaining = iter(urls)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(remaining)}} if part.get("type") == "image" else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def template_messages(messages: Messages) -> Messages:
    """The conversation as the chat template renders it: each image part a bare ``{"type": "image"}`` (one
    placeholder each), so that it is plain data (json-able, for the rendered-prompt cache)."""
    return [
        {**message, "content": [{"type": "image"} if part.get("type") == "image" else part for part in content]}
        if isinstance(content := message["content"], list) else message
        for message in messages
    ]  # fmt: skip


def data_url(image: Any) -> str:
    """A base64 PNG ``data:`` URL of the image (lossless: the server decodes the pixels the trainer processes)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


IMAGES_COLUMN = "images"
"""The completions table's column of a prompt's images (logging.log_multimodal)."""
THUMBNAIL_PIXELS = 128
"""A logged image's longest side at most."""


def thumbnail(image: Any) -> bytes:
    """The image shrunk to THUMBNAIL_PIXELS on its longest side, as PNG bytes (what the completions table logs)."""
    small = image.copy()
    small.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return buffer.getvalue()


def image_count(images: list[bytes]) -> str:
    """A row's images (the completions table's thumbnails) where a table shows text: how many."""
    return f"{len(images)} image{'' if len(images) == 1 else 's'}"


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [part for part in content if isinstance(part, dict)] if isinstance(content, list) else []


class ImageProcessing:
    """The checkpoint's image processor, and the images of the last CACHED_PROMPTS prompts as a request sends them
    (data URLs) and as the trainer takes them (``PromptImages``), keyed by the image objects (kept alive here, so
    their ids stay theirs)."""

    def __init__(self, image_processor: Any, token_id: int, merge_size: int) -> None:
        self.image_processor, self.token_id, self.merge_size = image_processor, token_id, merge_size
        self._cache: OrderedDict[tuple[int, ...], tuple[list[Any], list[str], PromptImages]] = OrderedDict()

    @classmethod
    def load(cls, path: str, model_config: Any, revision: str | None = None,
             trust_remote_code: bool = False) -> ImageProcessing:  # fmt: skip
        """The checkpoint's image processor (AutoImageProcessor: Qwen's full processor also builds a video processor,
        which needs torchvision), its image token and its vision tower's merge size."""
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
        token_id = getattr(model_config, "image_token_id", None)
        merge_size = getattr(getattr(model_config, "vision_config", None), "spatial_merge_size", None)
        if token_id is None or merge_size is None:
            raise ValueError(f"{path}: a vision-language config without image_token_id or vision_config."
                             "spatial_merge_size: asyncrl trains Qwen-style image placeholders")  # fmt: skip
        return cls(processor, int(token_id), int(merge_size))

    def patches(self, images: Sequence[Any]) -> PromptImages:
        """The images as the trainer takes them (the checkpoint's image processor)."""
        processed = self.image_processor(images=list(images), return_tensors="pt")
        return PromptImages(processed["pixel_values"], processed["image_grid_thw"], self.token_id, self.merge_size)

    def prepare(self, images: Sequence[Any]) -> tuple[list[str], PromptImages]:
        """The images' data URLs and patches, once per prompt."""
        key = tuple(id(image) for image in images)
        cached = self._cache.get(key)
        if cached is None:
            cached = (list(images), [data_url(image) for image in images], self.patches(images))
            self._cache[key] = cached
            if len(self._cache) > CACHED_PROMPTS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return cached[1], cached[2]

    def check(self, prompt_ids: Sequence[int], images: PromptImages) -> None:
        """The server's prompt holds one placeholder per merged patch of the images' grids: else its processor is
        not the checkpoint's (the trainer would misplace the patches)."""
        expected = int(images.image_grid_thw.prod(-1).sum()) // self.merge_size**2
        found = sum(1 for token in prompt_ids if token == self.token_id)
        if found != expected:
            raise ValueError(f"the server's prompt has {found} image placeholder tokens (id {self.token_id}) where "
                             f"the checkpoint's image processor makes {expected} merged patches: serve the same "
                             "checkpoint's processor (its preprocessor_config.json)")  # fmt: skip


def checkpoint_config(config: Config) -> Any:
    """model.name_or_path's config (AutoConfig, at model.revision)."""
    from transformers import AutoConfig

    m = config.model
    return AutoConfig.from_pretrained(m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code)


def image_processing(config: Config, model_config: Any = None) -> ImageProcessing:
    """model.name_or_path's image processing (``model_config``: its config, read here when not given)."""
    m = config.model
    model_config = model_config or checkpoint_config(config)
    return ImageProcessing.load(m.name_or_path, model_config, m.revision, m.trust_remote_code)


def image_prompt_tokens(config: Config) -> RowTokens:
    """A data.path row's prompt length as the server expands it: each image at its processed size
    (prompts.longest_prompt_tokens, for data with images)."""
    processing = image_processing(config)
    folder, kwargs = data_folder(config.data.path), config.sampling.chat_template_kwargs

    def tokens(tokenizer: Any, row: dict[str, Any]) -> int:
        prompt = place_row_images(row, folder)["prompt"]
        images = prompt_images(prompt)
        if not images:
            return len(render_prompt(tokenizer, prompt, kwargs))
        return len(processing.patches(images).expand(render_prompt(tokenizer, template_messages(prompt), kwargs)))

    return tokens
