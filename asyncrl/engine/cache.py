"""The running batch's cache: K/V layers with spare capacity and gated-DeltaNet state layers, both with row slots.

transformers' ``DynamicLayer`` concatenates the whole cache with every new token. ``SlackLayer`` keeps keys and
values in preallocated buffers ``[row_capacity, heads, column_capacity, head_dim]`` and exposes the window
``[:rows, :, start:start + width]`` as ``keys``/``values``: decoding writes the new column after the window,
rows joining the running batch are written right-aligned into their slots, dropping leading columns only moves
``start``. Buffers are reallocated (with slack, so amortised O(1) per token) only when the window outgrows them.
Buffers start zeroed and only ever hold computed keys and values, so masked positions are always finite and
contribute exactly nothing to attention.

A linear-attention layer (Qwen3.5's gated DeltaNet) caches no tokens, only per-row convolution and recurrent
states of a fixed size. ``StateLayer`` keeps them in row slots with the same row operations (a joining row's
states overwrite its slot whole, so nothing a dummy decoded there before survives; there are no columns to drop).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

MIN_SLACK_COLUMNS = 256


SLOT_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)
"""The cache layers of transformers that the running batch has a slot layer for."""
UNSERVED_LAYER_TYPES = ("chunked_attention",)
"""Layer types refused although their cache layer is a slot layer's: Llama 4's chunks start at multiples of the chunk
size in each row's own positions, which the mask would count in the batch's columns, shifted by a row's padding."""


def check_cache_supported(model: torch.nn.Module) -> None:
    """Fail at startup, naming the first layer type the running batch cannot serve (e.g. chunked attention)."""
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    for index, layer in enumerate(DynamicCache(config=model.config).layers):
        if type(layer) not in SLOT_LAYERS or (layer_types and layer_types[index] in UNSERVED_LAYER_TYPES):
            kind = f"{layer_types[index]!r} ({type(layer).__name__})" if layer_types else type(layer).__name__
            raise ValueError(
                f"the built-in server serves full_attention, sliding_attention and linear_attention (gated "
                f"DeltaNet) layers only; layer {index} is {kind}: serve this model with server.backend=vllm"
            )


def prefill_cache(model: torch.nn.Module) -> DynamicCache:
    """The model's own DynamicCache for a prefill, its sliding-window layers keeping every token: the running batch
    copies whole rows into its SlackLayers, and the window is the attention mask's (transformers builds a sliding
    layer's mask from the config's window over cache columns, and a row's columns are its consecutive positions)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


class SlackCache(DynamicCache):
    """The model's own DynamicCache with every attention layer a SlackLayer (a sliding-window one too: it keeps
    every column, its window being the mask's, as in ``prefill_cache``) and every linear-attention layer a
    StateLayer; its width is its attention layers' column count, whatever layer 0 is.

    transformers asks ``get_seq_length()`` (layer 0 by default) for the cached width when it builds masks and
    positions. Up to 5.24 a linear-attention layer 0 deferred to the first attention layer; from 5.25 it answers with
    its own decode counter, which a StateLayer (filled by copying prefill states, not by a forward) never raises."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(config=model.config)
        self.layers = [
            StateLayer(layer.number_of_states) if isinstance(layer, LinearAttentionLayer) else SlackLayer()
            for layer in self.layers
        ]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The width of the first attention layer (every attention layer has the same); 0 before any row joins."""
        return next((layer.get_seq_length() for layer in self.layers if isinstance(layer, SlackLayer)), 0)


class SlackLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys``/``values`` are views of larger, reused buffers."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._start = 0

    @property
    def rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def get_seq_length(self, *args: object) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` [rows, heads, new, head_dim] after the window, in place."""
        self._initialize(key_states)
        rows, width, new = key_states.shape[0], self.get_seq_length(), key_states.shape[2]
        if self.rows not in (0, rows):
            raise ValueError(f"SlackLayer.update got {rows} rows for a cache of {self.rows}")
        self._make_room(rows, left=0, right=new)
        end = self._start + width
        self._key_buffer[:rows, :, end : end + new] = key_states
        self._value_buffer[:rows, :, end : end + new] = value_states
        self._set_window(rows, width + new)
        return self.keys, self.values

    def write_rows(self, slots: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows' keys/values [len(slots), heads, length, head_dim] right-aligned into cache rows ``slots``;
        slots past the last row add rows, a length past the width widens every row on the left."""
        self._initialize(keys)
        rows = max(self.rows, max(slots) + 1)
        width, length = self.get_seq_length(), keys.shape[2]
        left = max(0, length - width)
        self._make_room(rows, left=left, right=0)
        self._start -= left
        width += left
        end = self._start + width
        index = torch.tensor(slots, device=keys.device)
        self._key_buffer[index, :, end - length : end] = keys
        self._value_buffer[index, :, end - length : end] = values
        self._set_window(rows, width)

    def write_prefill(self, slots: list[int], prefill: DynamicLayer, copies: torch.Tensor | None) -> None:
        """Write a prefill cache layer's rows into cache rows ``slots`` (``copies``: the prefilled row each slot
        takes, when several share one; None: one row each)."""
        keys, values = prefill.keys, prefill.values
        if copies is not None:
            keys, values = keys[copies], values[copies]
        self.write_rows(slots, keys, values)

    def keep_rows(self, slots: list[int]) -> None:
        """Keep cache rows ``slots``, in that order, as rows 0..len(slots)-1 (in place; a prefix costs nothing)."""
        if slots != list(range(len(slots))):
            index = torch.tensor(slots, device=self._key_buffer.device)
            columns = slice(self._start, self._start + self.get_seq_length())
            self._key_buffer[: len(slots), :, columns] = self._key_buffer[index, :, columns]
            self._value_buffer[: len(slots), :, columns] = self._value_buffer[index, :, columns]
        self._set_window(len(slots), self.get_seq_length())

    def drop_columns(self, count: int) -> None:
        """Forget the ``count`` leftmost columns (padding no row needs any more)."""
        self._start += count
        self._set_window(self.rows, self.get_seq_length() - count)

    def _initialize(self, like: torch.Tensor) -> None:
        if self.is_initialized:
            return
        self.dtype, self.device = like.dtype, like.device
        self._key_buffer = like.new_zeros(0, like.shape[1], 0, like.shape[3])
        self._value_buffer = like.new_zeros(0, like.shape[1], 0, like.shape[3])
        self._start = 0
        self._set_window(0, 0)
        self.is_initialized = True

    def _make_room(self, rows: int, left: int, right: int) -> None:
        """Ensure ``rows`` rows and ``left``/``right`` free columns beside the window, reallocating with slack."""
        capacity_rows, _, capacity_columns, _ = self._key_buffer.shape
        width = self.get_seq_length()
        if rows <= capacity_rows and left <= self._start and self._start + width + right <= capacity_columns:
            return
        if rows > capacity_rows:
            capacity_rows = max(rows, capacity_rows + capacity_rows // 2)
        needed = left + width + right
        shape = (
            capacity_rows,
            self._key_buffer.shape[1],
            needed + max(MIN_SLACK_COLUMNS, needed // 2),
            self._key_buffer.shape[3],
        )
        keys, values = self._key_buffer.new_zeros(shape), self._value_buffer.new_zeros(shape)
        keys[: self.rows, :, left : left + width] = self.keys
        values[: self.rows, :, left : left + width] = self.values
        self._key_buffer, self._value_buffer, self._start = keys, values, left

    def _set_window(self, rows: int, width: int) -> None:
        self.keys = self._key_buffer[:rows, :, self._start : self._start + width]
        self.values = self._value_buffer[:rows, :, self._start : self._start + width]


class StateLayer(LinearAttentionLayer):
    """A linear-attention cache layer whose per-row conv/recurrent states are views of buffers with spare rows.

    transformers' own layer decodes on it unchanged: a one-token step updates ``conv_states``/``recurrent_states``
    in place (``copy_``), which writes through the views into the buffers."""

    def __init__(self, number_of_states: int = 1) -> None:
        super().__init__(number_of_states=number_of_states)
        self._buffers: dict[str, dict[int, torch.Tensor]] = {"conv_states": {}, "recurrent_states": {}}
        self._rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    def write_prefill(self, slots: list[int], prefill: LinearAttentionLayer, copies: torch.Tensor | None) -> None:
        """Overwrite cache rows ``slots`` whole with a prefill cache layer's states (``copies`` as in SlackLayer);
        slots past the last row add rows."""
        rows = max(self._rows, max(slots) + 1)
        for kind, buffers in self._buffers.items():
            for state_idx, state in getattr(prefill, kind).items():
                if state is None:  # a layer may keep only a conv state
                    continue
                if copies is not None:
                    state = state[copies]
                buffers[state_idx] = self._with_rows(buffers.get(state_idx), state, rows)
                buffers[state_idx][torch.tensor(slots, device=state.device)] = state
                self.dtype, self.device = state.dtype, state.device
        self.conv_kernel_size = dict(prefill.conv_kernel_size)
        self._set_rows(rows)

    def keep_rows(self, slots: list[int]) -> None:
        """Keep rows ``slots``, in that order, as rows 0..len(slots)-1 (in place; a prefix costs nothing)."""
        if slots != list(range(len(slots))):
            for buffers in self._buffers.values():
                for buffer in buffers.values():
                    buffer[: len(slots)] = buffer[torch.tensor(slots, device=buffer.device)]
        self._set_rows(len(slots))

    def drop_columns(self, count: int) -> None:
        """States have no token columns: nothing to drop."""

    def _with_rows(self, buffer: torch.Tensor | None, like: torch.Tensor, rows: int) -> torch.Tensor:
        """``buffer`` if it holds ``rows`` rows, else a larger one (with slack) keeping the current rows."""
        if buffer is not None and rows <= buffer.shape[0]:
            return buffer
        capacity = rows if buffer is None else max(rows, buffer.shape[0] + buffer.shape[0] // 2)
        grown = like.new_zeros(capacity, *like.shape[1:])
        if buffer is not None:
            grown[: self._rows] = buffer[: self._rows]
        return grown

    def _set_rows(self, rows: int) -> None:
        self._rows = rows
        for kind, buffers in self._buffers.items():
            initialized = getattr(self, f"is_{kind}_initialized")
            for state_idx, buffer in buffers.items():
                getattr(self, kind)[state_idx] = buffer[:rows]
                initialized[state_idx] = True
                self.has_previous_state[state_idx] = True
