"""A packed row's images (Qwen's vision-language models): the images it passes to the vision tower, each once, in
the layout order of their placeholder tokens, and each token's M-RoPE position.

The packers call `row_images` (TreeRow keys placeholders through `DistinctImages` first, so that samples share an
image's tokens only when it is the same image, and only whole); `packed_forward` calls `image_inputs` and
`image_features`.

An image's placeholders are the runs of the placeholder token among the sample's context tokens (its prompt, and a
tool result's images in a multi-turn sample). A completion may hold the placeholder token too (a model can sample
any id): a trained token, it is text, so the forward writes the vision tower's features into the embeddings at the
images' runs itself, where the model's own forward would take every placeholder id in the row for an image's.

On several trainer ranks, FSDP gathers the tower's units on every rank or on none: a text row whose micro-batch has
images on another rank (``PackedRow.dummy_image``, set by trainer/distributed.py::split_rows) runs the tower on a
dummy image whose features join its embeddings with weight zero.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncrl.packing.row import PackedRow, RowImages
from asyncrl.rollout.types import PromptImages, RolloutSample

Image = tuple[torch.Tensor, torch.Tensor]
"""One image: its grid (t, h, w) and its pixel rows."""


def split_images(images: PromptImages) -> list[Image]:
    """Each image's grid and pixel rows (t * h * w of them), in prompt order."""
    patches = images.image_grid_thw.prod(-1).tolist()
    if sum(patches) != images.pixel_values.shape[0]:
        raise ValueError(f"PromptImages: grids {images.image_grid_thw.tolist()} hold {sum(patches)} patches, "
                         f"pixel_values has {images.pixel_values.shape[0]} rows")  # fmt: skip
    return list(zip(images.image_grid_thw, images.pixel_values.split(patches), strict=True))


def image_spans(sample: RolloutSample) -> list[tuple[int, int]]:
    """Each image's placeholder tokens [start, end) among the sample's context tokens (its prompt, and the tool
    results of a multi-turn one), in order: one contiguous run per image, of its merged patch count
    (t * h * w / merge_size**2), which is what the forward fills with the image's features."""
    images = sample.sequence.images
    assert images is not None
    patches = images.image_grid_thw.prod(-1).tolist()
    counts = [p // images.merge_size**2 for p in patches]
    sequence = sample.sequence
    at = [i for i, (token, trained) in enumerate(zip(sequence.token_ids, sequence.mask, strict=True))
          if token == images.token_id and not trained]  # fmt: skip
    spans, used = [], 0
    for count in counts:
        run = at[used : used + count]
        used += count
        if run and len(run) == count and run[-1] - run[0] == count - 1:
            spans.append((run[0], run[-1] + 1))
    if len(spans) != len(counts) or used != len(at) or any(p % images.merge_size**2 for p in patches):
        raise ValueError(
            f"sample {sample.rollout_id}: {len(at)} image placeholder tokens (id {images.token_id}) where its "
            f"grids {images.image_grid_thw.tolist()} merge ({images.merge_size}x{images.merge_size}) to {counts} "
            "patches, one contiguous run of placeholders per image"
        )
    return spans


class DistinctImages:
    """The distinct images (equal grid and pixels) a tree row has seen. The trie keys an image's placeholders by its
    index here rather than by the placeholder id, the same for every image: prompts alike but for their images share
    no image token."""

    def __init__(self) -> None:
        self._images: list[Image] = []
        self._known: dict[int, tuple[PromptImages, list[int]]] = {}

    def indices(self, images: PromptImages) -> list[int]:
        """Each image's index, in prompt order; remembered per object, as the planner prices a sample on every row
        before adding it to one."""
        known = self._known.get(id(images))
        if known is None or known[0] is not images:
            known = (images, [self._index(image) for image in split_images(images)])
            self._known[id(images)] = known
        return known[1]

    def _index(self, image: Image) -> int:
        for index, (grid, pixels) in enumerate(self._images):
            if torch.equal(grid, image[0]) and torch.equal(pixels, image[1]):
                return index
        self._images.append(image)
        return len(self._images) - 1


def row_images(samples: list[RolloutSample], offsets: list[list[int]]) -> RowImages | None:
    """The row's images for the model (None for a row without any): each image once per run of placeholders in the
    layout (a prompt that a group shares in a tree row is one path, so its images pass once), in layout order, with
    the layout positions of their placeholders. ``offsets[s][i]``: layout position of token i of sample s."""
    first: dict[int, tuple[Image, list[int]]] = {}
    layouts: list[tuple[int, torch.Tensor]] = []
    kinds: set[tuple[int, int]] = set()
    for s, (sample, layout) in enumerate(zip(samples, offsets, strict=True)):
        images = sample.sequence.images
        if images is None:
            continue
        kinds.add((images.token_id, images.merge_size))
        layouts.append((s, torch.tensor(layout, dtype=torch.long)))
        for (start, end), image in zip(image_spans(sample), split_images(images), strict=True):
            first.setdefault(layout[start], (image, layout[start:end]))
    if not layouts:
        return None
    if len(kinds) != 1:
        raise ValueError(f"a row's samples disagree on their images' (placeholder token, merge size): {sorted(kinds)}")
    ((token_id, merge_size),) = kinds
    order = [first[at] for at in sorted(first)]
    grids = torch.stack([grid for (grid, _), _ in order])
    pixels = torch.cat([rows for (_, rows), _ in order])
    positions = torch.tensor([at for _, run in order for at in run], dtype=torch.long)
    return RowImages(pixels, grids, token_id, merge_size, layouts, positions)


def image_inputs(model: Any, row: PackedRow, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's inputs for a row with images: its tokens, and position ids [4, 1, L]: each token's text position
    (its depth, as in a text row), then its M-RoPE (t, h, w) position (mrope_positions). The images' features join
    the embeddings through ``image_features``."""
    images = row.images
    assert images is not None
    vision = getattr(model.config, "vision_config", None)
    expected = (getattr(model.config, "image_token_id", None), getattr(vision, "spatial_merge_size", None))
    if expected != (images.token_id, images.merge_size):
        raise ValueError(f"packed_forward: the row's images are placeholder token {images.token_id} merged "
                         f"{images.merge_size}x{images.merge_size}; {type(model).__name__}'s config says "
                         f"image_token_id={expected[0]}, vision_config.spatial_merge_size={expected[1]}")  # fmt: skip
    positions = torch.cat([row.position_ids[None], mrope_positions(model, row)])
    return {"input_ids": row.input_ids[None].to(device), "position_ids": positions[:, None].to(device)}


@contextlib.contextmanager
def image_features(model: Any, row: PackedRow, device: torch.device) -> Iterator[None]:
    """While the model runs on ``row``: the vision tower's features replace the embeddings of the images'
    placeholders, as the text model receives them (a forward pre-hook on it). Inside the model's forward, so that
    FSDP has gathered the vision tower's weights, and at the images' runs only: the model's own merge would take
    every placeholder id in the row, a completion's too. A text row runs as it is, unless another rank's row of its
    micro-batch has images (``PackedRow.dummy_image``): it then runs the tower on a dummy image (``dummy_merge``)."""
    if row.images is None and not row.dummy_image:
        yield
        return
    owner = next((m for m in model.modules() if _runs_images(m)), None)
    if owner is None:
        raise ValueError(f"packed_forward: a row of the micro-batch has images, but {type(model).__name__} has no "
                         "get_image_features beside a language_model (Qwen's vision-language models)")  # fmt: skip
    merge = image_merge(owner, row.images, device) if row.images is not None else dummy_merge(owner, device)
    handle = owner.language_model.register_forward_pre_hook(merge, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


Hook = Callable[[torch.nn.Module, tuple, dict[str, Any]], tuple[tuple, dict[str, Any]]]
"""A forward pre-hook (with_kwargs) on the text model that changes its inputs_embeds."""


def image_merge(owner: torch.nn.Module, images: RowImages, device: torch.device) -> Hook:
    """The hook that writes the row's images' features at their placeholders' positions."""

    def merge(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        features = tower_features(owner, images.pixel_values.to(device), images.image_grid_thw.to(device))
        embeds = kwargs["inputs_embeds"]
        if features.shape[0] != images.positions.numel():
            raise ValueError(f"packed_forward: the vision tower made {features.shape[0]} image features for "
                             f"{images.positions.numel()} placeholders")  # fmt: skip
        at = images.positions.to(device)
        kwargs["inputs_embeds"] = embeds.index_put((torch.zeros_like(at), at), features.to(embeds.dtype))
        return args, kwargs

    return merge


def dummy_merge(owner: torch.nn.Module, device: torch.device) -> Hook:
    """The hook of a text row whose micro-batch has images on another rank: the tower runs on ``dummy_image``, so
    FSDP gathers its units here as there, and its features join the embeddings with weight zero, so that backward
    reaches the tower too (a trained tower's gradients, zero here, are reduce-scattered on every rank). Exact: adding
    0.0 changes no finite embedding, and their gradient passes through an addition unchanged."""

    def merge(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        grid, pixels = dummy_image(owner.config.vision_config, device)
        features = tower_features(owner, pixels, grid)
        embeds = kwargs["inputs_embeds"]
        kwargs["inputs_embeds"] = embeds + 0.0 * features.sum().to(embeds.dtype)
        return args, kwargs

    return merge


def tower_features(owner: torch.nn.Module, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """[merged patches, hidden] features of the images, in order, by the model's own get_image_features."""
    return torch.cat(list(owner.get_image_features(pixels, grids).pooler_output))


def dummy_image(vision: Any, device: torch.device) -> Image:
    """The smallest image the tower takes, from its ``vision_config``: one merged patch (grid 1 x merge x merge) of
    zero pixels."""
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return grid, torch.zeros(merge * merge, width, device=device)


def _runs_images(module: torch.nn.Module) -> bool:
    """The module that runs the vision tower and then its text model (Qwen3_5Model, Qwen3VLModel, ...)."""
    return hasattr(type(module), "get_image_features") and isinstance(getattr(module, "language_model", None),
                                                                      torch.nn.Module)  # fmt: skip


def mrope_positions(model: Any, row: PackedRow) -> torch.Tensor:
    """[3, L] M-RoPE positions: each sample's computed alone by the model's own get_rope_index from its tokens and
    grids, so they are what the model gives the sample unpacked. Computed at forward time, not at pack time: the rope
    index is a method of the model (it reads the model's config), and the packers have no model. Text-only samples
    keep their depth on all three axes, as the model gives text. A token's position depends only on the tokens
    before it and their images, so samples sharing a trie node agree on it (checked)."""
    images = row.images
    assert images is not None
    rope_index = _rope_index(model)
    positions = row.position_ids.expand(3, -1).clone()
    placed = torch.zeros(row.num_forwarded, dtype=torch.bool)
    for s, layout in images.layouts:
        sample = row.samples[s]
        own = rope_index(torch.tensor(sample.sequence.token_ids, dtype=torch.long), sample)
        shared = placed[layout]
        if not torch.equal(positions[:, layout[shared]], own[:, shared]):
            raise RuntimeError(f"packed_forward: sample {sample.rollout_id}'s M-RoPE positions differ from "
                               "another sample's on the tokens they share")  # fmt: skip
        positions[:, layout] = own
        placed[layout] = True
    return positions


def _rope_index(model: Any) -> Callable[[torch.Tensor, RolloutSample], torch.Tensor]:
    """One sample's [3, n] positions by the model's get_rope_index, told where the images are by the tokens'
    modality (mm_token_type_ids, 1 = image: the images' runs, not a completion's placeholder ids), as Qwen2-VL's,
    Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's take it in transformers 5.17 and 5.25."""
    owner = next((m for m in model.modules() if hasattr(type(m), "get_rope_index")), None)
    if owner is None or "mm_token_type_ids" not in inspect.signature(owner.get_rope_index).parameters:
        raise ValueError(f"packed_forward: a row has images, but {type(model).__name__} has no get_rope_index("
                         "input_ids, mm_token_type_ids, image_grid_thw) for their M-RoPE positions (the method of "
                         "Qwen's vision-language models that packing/images.py calls)")  # fmt: skip

    def rope_index(tokens: torch.Tensor, sample: RolloutSample) -> torch.Tensor:
        images = sample.sequence.images
        assert images is not None
        modality = torch.zeros_like(tokens, dtype=torch.int)
        for start, end in image_spans(sample):
            modality[start:end] = 1
        positions, _ = owner.get_rope_index(
            tokens[None], mm_token_type_ids=modality[None], image_grid_thw=images.image_grid_thw
        )
        return positions[:, 0]

    return rope_index
