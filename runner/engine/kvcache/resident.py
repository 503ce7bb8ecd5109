"""Device-resident KV without whole-prefix copies: buffers that grow geometrically and are written in place.

transformers' `DynamicLayer` copies the layer's whole prefix at every update (O(n^2) bytes over a
generation); `GrowingLayer` writes into a buffer grown by `GROWTH` (in `GRANULE_TOKENS`) and hands attention
views of the valid tokens, so the same tokens (docs/kv-cache.md, "Resident buffers written in place").
The in-place writes make it inference-only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from jobs.kvplan import KVShape

GROWTH = 1.5
"""Capacity factor per reallocation: O(n) total copying, at most a third of the buffer left unused."""
GRANULE_TOKENS = 64
"""Capacities are multiples of this many tokens, so small prompts and chunk sizes don't cause odd sizes."""
NOTHING_OFFLOADED = {"offload_bytes_written": 0, "offload_bytes_read": 0, "compression_ratio": None}
"""The offload columns of a cache whose KV stays on the device."""


class GrowingLayer(DynamicLayer):
    """A full-attention layer whose KV grows in place; `.keys` / `.values` are views of the valid tokens."""

    grows = True
    """It keeps room beyond its tokens (`capacity`) and grows geometrically: its allocation is that room."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None  # the key and value buffers
        self._length = 0
        self._token_bytes = 0  # keys and values of one token, all rows and heads

    # --- capacity: what the budget guard of the owning cache reasons about ----------------------

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold room for (0 before the first update)."""
        return self._pair[0].shape[-2] if self._pair is not None else 0

    def bytes_for(self, tokens: int) -> int:
        """Bytes both buffers take at a capacity of `tokens` (0 until the layer has seen its first tokens)."""
        return tokens * self._token_bytes

    def grow_to(self, capacity: int) -> None:
        """Reallocate to `capacity` tokens (never below the valid length), copying only the valid prefix."""
        capacity = max(capacity, self._length)
        if capacity == self.capacity:
            return
        self._adopt(*(_copied(buffer, self._length, capacity) for buffer in self._buffers))

    def trim(self) -> None:
        """Give back the unused capacity (when a budget needs it for another layer)."""
        if self.is_initialized:
            self.grow_to(self._length)

    # --- the forward pass ----------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._length = 0
        self._adopt(*(kv.new_empty((*kv.shape[:-2], 0, kv.shape[-1])) for kv in (key_states, value_states)))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self.capacity:
            self.grow_to(next_capacity(self.capacity, end))
        for buffer, states in zip(self._buffers, (key_states, value_states)):
            buffer[:, :, start:end].copy_(states)
        self._length = end
        self._expose()
        return self.keys, self.values

    @property
    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._pair is not None, "layer not initialized"
        return self._pair

    def _adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        """Take new buffers (grown, reshaped in batch, moved), so capacity and byte counts follow them."""
        self._pair = (key_buffer, value_buffer)
        self._token_bytes = sum(b.shape[:-2].numel() * b.shape[-1] * b.element_size() for b in self._buffers)
        self._expose()

    def _expose(self) -> None:
        """Point `.keys` / `.values` (read by attention, transformers and our meters) at the valid tokens."""
        self.keys, self.values = (buffer[:, :, : self._length] for buffer in self._buffers)

    # --- CacheLayerMixin -----------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._pair = None
        self._length = self._token_bytes = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens (DynamicLayer checks the count and cuts `.keys`); the
        capacity stays for the tokens that replace them."""
        super().crop(tokens_to_remove)
        if self.is_initialized:
            self._length = self.keys.shape[-2]
            self._expose()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows rearranged in place (through one valid-length temporary, as DynamicLayer does)."""
        if self._length > 0:
            rows = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, rows))
            self.values.copy_(self.values.index_select(0, rows))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._length > 0:
            self.batch_select_indices(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._length > 0:
            self._adopt(*(_copied(buffer, self._length, self.capacity, indices) for buffer in self._buffers))


def kv_shape(model_config: PretrainedConfig, dtype: torch.dtype | None = None) -> KVShape:
    """The planner's view of a model; `dtype` defaults to the config's (float32 when it has none)."""
    text = model_config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    if dtype is None:
        configured = getattr(text, "dtype", None) or getattr(model_config, "dtype", None)
        dtype = getattr(torch, configured) if isinstance(configured, str) else configured or torch.float32
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    return KVShape(
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        dtype_bytes=dtype.itemsize,
        # the most tokens a layer keeps: None when it keeps them all (and for types we cannot bound)
        layer_windows=tuple(0 if kind == "dummy" else kwargs.get("sliding_window")
                            for kind, kwargs in zip(layer_types, layer_kwargs)),
    )


def next_capacity(capacity: int, needed: int) -> int:
    """The geometric step from `capacity` for `needed` tokens: GROWTH × capacity or `needed`, in granules."""
    return granule(max(needed, math.ceil(capacity * GROWTH)))


def granule(tokens: int) -> int:
    """`tokens` (at least one) rounded up to GRANULE_TOKENS."""
    return -(-max(tokens, 1) // GRANULE_TOKENS) * GRANULE_TOKENS


def allocated_bytes(layer: Any) -> int:
    """What a layer kept on the device allocates there: a GrowingLayer's whole capacity, another
    layer's tensors (0 before its first update)."""
    if getattr(layer, "grows", False):
        return layer.bytes_for(layer.capacity)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    return keys.nbytes + values.nbytes if keys is not None else 0


def _copied(buffer: torch.Tensor, length: int, capacity: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A new buffer of `capacity` tokens holding the valid `length` tokens of `buffer` (of `rows` only, in order)."""
    valid = buffer[:, :, :length] if rows is None else buffer[:, :, :length][rows, ...]
    out = buffer.new_empty((valid.shape[0], *buffer.shape[1:-2], capacity, buffer.shape[-1]))
    out[:, :, :length].copy_(valid)
    return out
