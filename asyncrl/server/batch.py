"""The running batch: rows decoded together in one forward and their shared, left-padded KV cache.

Rows join through a prefill of their tokens (prompt, plus what they generated before a preemption) and
leave when they finish. Every row is left-padded to the batch width; the attention mask hides the padding
and explicit position ids count only a row's own tokens, so a row's logits do not depend on its neighbours.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from asyncrl.server.lora import AdapterSet
from asyncrl.server.rows import Row


def check_cache_supported(model: torch.nn.Module) -> None:
    """Fail at startup for models whose cache layers are not plain growing layers (e.g. sliding windows)."""
    layers = DynamicCache(config=model.config).layers
    unsupported = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if unsupported:
        raise ValueError(f"the built-in server supports full-attention caches only; this model uses {unsupported}")


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    padding = tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3])
    return torch.cat([padding, tensor], dim=2)


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
        self.rows: list[Row] = []
        self._cache: DynamicCache | None = None

    @property
    def width(self) -> int:
        return 0 if self._cache is None else self._cache.get_seq_length()

    def kv_tokens(self) -> int:
        """Cached tokens over all rows, padding excluded."""
        return sum(row.cached_len for row in self.rows)

    def decode(self) -> torch.Tensor:
        """Feed every row its pending token; return next-token logits [rows, vocab]."""
        lengths = torch.tensor([row.cached_len for row in self.rows], device=self._device)
        input_ids = torch.tensor([[row.output_ids[-1]] for row in self.rows], device=self._device)
        logits = self._forward(input_ids, lengths + 1, lengths.unsqueeze(1), self._cache, self.rows)
        for row in self.rows:
            row.cached_len += 1
        return logits

    def join(self, rows: list[Row]) -> torch.Tensor:
        """Prefill ``rows`` together, merge their cache into the batch; return their next-token logits."""
        sequences = [row.tokens() for row in rows]
        width = max(len(tokens) for tokens in sequences)
        input_ids = torch.tensor([[0] * (width - len(s)) + s for s in sequences], device=self._device)
        lengths = torch.tensor([len(s) for s in sequences], device=self._device)
        positions = (torch.arange(width, device=self._device) - (width - lengths).unsqueeze(1)).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, lengths, positions, cache, rows)
        for row, tokens in zip(rows, sequences, strict=True):
            row.cached_len = len(tokens)
        self._merge(cache)
        self.rows.extend(rows)
        return logits

    def remove(self, leaving: list[Row]) -> None:
        """Drop rows from the batch and trim padding that no remaining row needs."""
        if not leaving:
            return
        for row in leaving:
            row.cached_len = 0
        keep = [i for i, row in enumerate(self.rows) if row not in leaving]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows or self._cache is None:
            self._cache = None
            return
        index = torch.tensor(keep, device=self._device)
        start = self.width - max(row.cached_len for row in self.rows)
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    def clear(self) -> list[Row]:
        """Drop every row and the cache (preemption): the rows must be prefilled again to continue."""
        rows = self.rows
        self.remove(list(rows))
        return rows

    def _merge(self, cache: DynamicCache) -> None:
        if self._cache is None:
            self._cache = cache
            return
        width = max(self.width, cache.get_seq_length())
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])

    def _forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
        rows: list[Row],
    ) -> torch.Tensor:  # fmt: skip
        """Run the model, each row under its adapter; ``lengths`` are the rows' lengths in the cache after it."""
        width = cache.get_seq_length() + input_ids.shape[1]
        mask = torch.arange(width, device=self._device).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        adapters = self._adapters.select(self.model, [row.request.adapter for row in rows]) if self._adapters else {}
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask.long(),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **adapters,
            **{self._cache_argument: cache},
        )
        return output.logits[:, -1, :].float()
