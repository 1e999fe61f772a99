"""The running batch: rows decoded together in one forward and their shared, left-padded KV cache.

Rows join through a prefill of their tokens (prompt, plus what they generated before a preemption) and
leave when they finish. Every row is left-padded to the batch width; the attention mask hides the padding
and explicit position ids count only a row's own tokens, so a row's logits do not depend on its neighbours.
Each row owns a slot (a row of the cache, see ``cache.py``). A leaving row frees its slot without moving the
cache; the next joining row takes it. Free slots are decoded as one-token dummies whose logits are dropped,
and the slots are compacted once at least half of them are free.

Gated-DeltaNet hybrids (Qwen3.5) keep per-row convolution and recurrent states instead of keys and values in
their linear-attention layers (``StateLayer``). Left padding is exact for them too: transformers multiplies a
linear-attention layer's input by the prefill's attention mask, and its input projections and convolution have
no bias, so a padded position feeds exact zeros to the short convolution (which then reads what a fresh state
holds: zeros) and a zero key and value to the delta rule (which leaves the zero initial state at zero whatever
the decay). Only rounding differs (the chunked delta rule's 64-token chunks fall elsewhere): tests/engine/
test_hybrid_batch.py finds the states within 1e-6 and logprobs within 1e-4 of an unpadded forward. A free slot's
dummy decodes into its states, but a row taking the slot overwrites them whole.

Rows with images (``images.py``) join through a prefill of input embeddings in which the vision tower's features
replace their image tokens', at Qwen's M-RoPE positions: position ids are then [4, rows, width], the text positions
(which masks read) over the three M-RoPE axes, and a row without images has its text positions on all four. Each
decoding step gives a row with images its text position plus its ``rope_delta``. A re-prefilled row (preemption)
takes its images again from its request.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from asyncrl.engine.cache import SlackCache, prefill_cache
from asyncrl.engine.images import ImageInputs
from asyncrl.engine.lora import AdapterSet
from asyncrl.engine.rows import DecodeRow

# Every SDPA backend but cuDNN: cuDNN builds an execution plan per input shape, and the cache grows a column every
# decoding step, so each step rebuilt one per layer (1.7 ms of host time each: 80 ms steps for Qwen3-0.6B on an H200).
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RunningBatch:
    """Rows being decoded and their cache; only the engine thread touches it, under the engine's step lock."""

    def __init__(self, model: torch.nn.Module, adapters: AdapterSet | None = None) -> None:
        self.model = model
        """Set anew by the engine when loading or unloading an adapter wraps or unwraps it."""
        self._adapters = adapters
        self._device = next(model.parameters()).device
        # transformers renamed the forward's `past_key_values` argument to `cache`; accept either.
        forward_parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self.rows: list[DecodeRow] = []
        """Running rows in the order they joined (the order of decode's logits)."""
        self._slots: list[DecodeRow | None] = []
        self._slot_of: dict[DecodeRow, int] = {}
        self._cache: SlackCache | None = None

    @property
    def width(self) -> int:
        return 0 if self._cache is None else self._cache.get_seq_length()

    def kv_tokens(self) -> int:
        """Cached tokens over all rows, padding excluded."""
        return sum(row.cached_len for row in self.rows)

    def decode(self) -> torch.Tensor:
        """Feed every row its pending token; return next-token logits [rows, vocab] in ``rows`` order."""
        # A free slot decodes token 0 at position 0 under some row's adapter (so one adapter stays the fast path).
        lengths = torch.tensor([0 if row is None else row.cached_len for row in self._slots], device=self._device)
        tokens = [[0 if row is None else row.output_ids[-1]] for row in self._slots]
        input_ids = torch.tensor(tokens, device=self._device)
        adapters = [(row or self.rows[0]).request.adapter for row in self._slots]
        positions = self._decode_positions(lengths)
        logits = self._forward({"input_ids": input_ids}, lengths + 1, positions, self._cache, adapters)
        for row in self.rows:
            row.cached_len += 1
        if self._slots == self.rows:
            return logits
        return logits[torch.tensor([self._slot_of[row] for row in self.rows], device=self._device)]

    def join(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Prefill ``rows`` together, write their cache into free slots; return their next-token logits.

        Rows with the same tokens under the same adapter and images (a GRPO group's rollouts arrive together with
        one prompt) are prefilled once and their cache copied, so a group of G costs one prompt's prefill, not G."""
        sequences = [row.tokens() for row in rows]
        distinct: dict[tuple[tuple[int, ...], str | None, ImageInputs | None], int] = {}
        source = [
            distinct.setdefault((tuple(tokens), row.request.adapter, row.request.images), len(distinct))
            for tokens, row in zip(sequences, rows, strict=True)
        ]
        leaders = [source.index(index) for index in range(len(distinct))]  # the first row of each distinct sequence
        unique = [sequences[leader] for leader in leaders]
        adapters = [rows[leader].request.adapter for leader in leaders]
        images = [rows[leader].request.images for leader in leaders]
        width = max(len(tokens) for tokens in unique)
        input_ids = torch.tensor([[0] * (width - len(s)) + s for s in unique], device=self._device)
        lengths = torch.tensor([len(s) for s in unique], device=self._device)
        positions = (torch.arange(width, device=self._device) - (width - lengths).unsqueeze(1)).clamp(min=0)
        inputs = {"input_ids": input_ids}
        if any(inputs is not None for inputs in images):
            positions = self._prefill_positions(positions, unique, images)
            inputs = {"inputs_embeds": self._embed_images(input_ids, width - lengths, images)}
        cache = prefill_cache(self.model)
        logits = self._forward(inputs, lengths, positions, cache, adapters)
        for row, tokens in zip(rows, sequences, strict=True):
            row.cached_len = len(tokens)
        copies = None if len(unique) == len(rows) else torch.tensor(source, device=self._device)
        self._place(rows, cache, copies)
        self.rows.extend(rows)
        return logits if copies is None else logits[copies]

    def remove(self, leaving: list[DecodeRow]) -> None:
        """Drop rows from the batch, free their slots and forget padding that no remaining row needs."""
        if not leaving:
            return
        gone = set(leaving)
        for row in leaving:
            row.cached_len = 0
            if (slot := self._slot_of.pop(row, None)) is not None:
                self._slots[slot] = None
        self.rows = [row for row in self.rows if row not in gone]
        if not self.rows or self._cache is None:
            self.clear()
            return
        while self._slots[-1] is None:
            self._slots.pop()
        kept = list(range(len(self._slots)))
        if 2 * len(self.rows) <= len(self._slots):
            kept, self._slots = [self._slot_of[row] for row in self.rows], list(self.rows)
            self._slot_of = {row: slot for slot, row in enumerate(self.rows)}
        unused = self.width - max(row.cached_len for row in self.rows)
        for layer in self._cache.layers:
            layer.keep_rows(kept)
            layer.drop_columns(unused)

    def clear(self) -> list[DecodeRow]:
        """Drop every row and the cache (preemption): the rows must be prefilled again to continue."""
        rows, self.rows = self.rows, []
        for row in rows:
            row.cached_len = 0
        self._cache, self._slots, self._slot_of = None, [], {}
        return rows

    def _place(self, rows: list[DecodeRow], cache: DynamicCache, copies: torch.Tensor | None) -> None:
        """Give each joining row a slot (free ones first) and copy its prefilled cache there (``copies``: which
        prefilled sequence each row takes, when several rows share one)."""
        if self._cache is None:
            self._cache = SlackCache(self.model)
        free = [slot for slot, row in enumerate(self._slots) if row is None]
        slots = (free + list(range(len(self._slots), len(self._slots) + len(rows))))[: len(rows)]
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.write_prefill(slots, theirs, copies)
        self._slots.extend([None] * (max(slots) + 1 - len(self._slots)))
        for row, slot in zip(rows, slots, strict=True):
            self._slots[slot] = row
            self._slot_of[row] = slot

    def _decode_positions(self, lengths: torch.Tensor) -> torch.Tensor:
        """Each slot's position for its next token: its cached length, [slots, 1]; while a row with images runs,
        [4, slots, 1], the text positions over M-RoPE's three, which run ``rope_delta`` ahead for rows with images."""
        if all(row.request.images is None for row in self.rows):
            return lengths.unsqueeze(1)
        images = [None if row is None else row.request.images for row in self._slots]
        deltas = [0 if inputs is None else inputs.rope_delta for inputs in images]
        shifted = lengths + torch.tensor(deltas, device=self._device)
        return torch.stack([lengths, shifted, shifted, shifted]).unsqueeze(2)

    def _prefill_positions(
        self, positions: torch.Tensor, sequences: list[list[int]], images: list[ImageInputs | None]
    ) -> torch.Tensor:
        """[4, rows, width]: the left-padded text positions over each row's M-RoPE positions (its images' layout,
        or its text positions when it has none)."""
        mrope = positions.unsqueeze(0).repeat(4, 1, 1)
        for row, (tokens, inputs) in enumerate(zip(sequences, images, strict=True)):
            if inputs is not None:
                mrope[1:, row, mrope.shape[2] - len(tokens) :] = inputs.positions(len(tokens)).to(self._device)
        return mrope

    def _embed_images(
        self, input_ids: torch.Tensor, padding: torch.Tensor, images: list[ImageInputs | None]
    ) -> torch.Tensor:
        """The prefill's input embeddings with each image token's replaced by the vision tower's features. Done
        here rather than by the model, which would take every image token id in the rows as an image's, also one
        that a row generated before it was preempted."""
        present = [(row, inputs) for row, inputs in enumerate(images) if inputs is not None]
        pixel_values = torch.cat([inputs.pixel_values for _, inputs in present]).to(self._device)
        grid = torch.cat([inputs.image_grid_thw for _, inputs in present]).to(self._device)
        features = torch.cat(self.model.get_image_features(pixel_values, grid).pooler_output)
        rows = torch.cat([torch.full_like(inputs.token_indices, row) for row, inputs in present]).to(self._device)
        columns = torch.cat([inputs.token_indices.to(self._device) + padding[row] for row, inputs in present])
        embeds = self.model.get_input_embeddings()(input_ids)
        embeds[rows, columns] = features.to(embeds.dtype)
        return embeds

    def _forward(
        self,
        inputs: dict[str, torch.Tensor],
        lengths: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        adapters: list[str | None],
    ) -> torch.Tensor:
        """Run the model on ``inputs`` (input_ids or inputs_embeds), each row under its adapter; ``lengths`` are the
        rows' lengths in the cache after it."""
        width = cache.get_seq_length() + positions.shape[-1]
        mask = torch.arange(width, device=self._device).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        extra = self._adapters.select(self.model, adapters) if self._adapters else {}
        with sdpa_kernel(ATTENTION_BACKENDS):
            output = self.model(
                **inputs,
                attention_mask=mask.long(),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **extra,
                **{self._cache_argument: cache},
            )
        return output.logits[:, -1, :].float()
