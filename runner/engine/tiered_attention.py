"""The tiered rows of one decode step: one K/V write and one attention call per streamed layer for all of them.

A tiered row's streamed layer lives in host RAM or block files and comes to the device for its turn
in the forward pass (runner/engine/kvcache/tiered.py). Per row, that turn used to be its own buffers,
its own write of the new token and its own attention call. Here the step's tiered rows share two
staging buffers, [2, rows, kv_heads, span, head_dim] (keys, then values), used by alternate layers:
each row's read of a layer (the prefetch on its IO thread, during the layer before) fills its slot
of one, while the layer before attends over the other. The step then writes every row's new K/V with
one indexed write and attends with one call of the model's attention, each row to its own length
through an additive mask, as the pooled rows do (runner/engine/pooled_attention.py).

What stays per row is what has to: each row's copies between its own host storage and its slot
(its blocks and its tail in, its new token out), counted in its cache's traffic where they happen.
A layer that any of the step's tiered rows keeps on the device, or as a sliding window, is attended
row by row as before (`TieredCache.streams`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from runner.engine.kvcache.layer_store import Slot
from runner.engine.kvcache.tiered import TieredCache
from runner.engine.pooled_attention import length_mask


class TieredStep:
    """`caches` are the step's tiered rows, in the step's row order."""

    def __init__(self, caches: Sequence[TieredCache]) -> None:
        self.caches = list(caches)
        self.count = len(caches)
        self.lengths: list[int] = []
        self.span = 0
        self.staged: list[torch.Tensor] = []  # the two staging buffers, by layer parity: [2 (keys, values), rows, ...]
        self.slots: list[list[Slot]] = []  # [parity][row]: views of the staging buffers
        self.mask: torch.Tensor | None = None
        self._following: list[Slot] = []
        self._rows: torch.Tensor | None = None  # 0 .. rows - 1, and each row's position: where `write` puts them
        self._positions: torch.Tensor | None = None

    def batches(self, layer_idx: int) -> bool:
        """Whether every tiered row streams layer `layer_idx` (else the layer goes row by row)."""
        return all(cache.streams(layer_idx) for cache in self.caches)

    def prepare(self, layer_idx: int, like: torch.Tensor) -> None:
        """Before the rows' `take`s of layer `layer_idx`: staging buffers and mask for the rows'
        lengths (the same at every layer of a step), and the slots the next layer is read into."""
        self._shape([cache.layers[layer_idx].store.seq_len for cache in self.caches], like)
        following = self.slots[1 - layer_idx % 2]
        if like.is_cuda:  # that buffer's last reader (the layer before) is queued by now: its reads wait for it
            free = torch.cuda.current_stream(like.device).record_event()
            following = [dataclasses.replace(slot, free=free) for slot in following]
        self._following = following

    def _shape(self, lengths: list[int], like: torch.Tensor) -> None:
        if lengths == self.lengths:
            return
        self.lengths, self.span = lengths, max(lengths) + 1
        shape = (2, self.count, like.shape[1], self.span, like.shape[3])
        # zeros, not empty: a row's masked tail is still read, and garbage NaN times a zero weight is NaN
        self.staged = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
        self.slots = [[Slot(staged[:, row : row + 1]) for row in range(self.count)] for staged in self.staged]
        self.mask = length_mask([n + 1 for n in lengths], self.span, like.dtype, like.device)
        self._rows = torch.arange(self.count, device=like.device)
        self._positions = torch.tensor(lengths, device=like.device)

    def outgoing(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Every row's new K/V ([rows, kv_heads, 1, head_dim] each) stacked as the tails hold a token
        ([rows, 2, kv_heads, head_dim]): one op, so each row's copy to its tail is one contiguous copy."""
        return torch.stack((keys[:, :, 0], values[:, :, 0]), dim=1)

    def take(self, row: int, layer_idx: int, outgoing: torch.Tensor) -> None:
        """Row `row`'s old tokens of the layer into its slot, its new one (its row of `outgoing`) to
        its tier; the next layer read ahead into its slot of the other buffer."""
        slot = self.slots[layer_idx % 2][row]
        pair = outgoing[row : row + 1, :, None]  # (1 token, 2, 1 row, kv_heads, head_dim), a view
        self.caches[row].update_in_slot(pair, layer_idx, slot, self._following[row], self.count)

    def write(self, layer_idx: int, outgoing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's new K/V (`outgoing`) into its slot, one index_put_; the staged K/V of the layer."""
        staged = self.staged[layer_idx % 2]
        staged[:, self._rows, :, self._positions] = outgoing  # indexed: [rows, 2, kv_heads, head_dim]
        return staged[0], staged[1]

    def attend(self, inner: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """One call of the model's attention over the staged rows; their outputs, in row order."""
        return inner(module, query, key, value, self.mask, **kwargs)[0]
