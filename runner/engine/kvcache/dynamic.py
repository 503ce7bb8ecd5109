"""`dynamic` with the budget guard: every layer on the device, refusing to outgrow a device budget.

Full-attention layers are `GrowingLayer`s; sliding-window layers stay transformers' own. The meter counts
the real allocation before anything grows, so the ladder is exercised on the CPU as a CUDA OOM would be.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

from runner.engine.kvcache.budget import ResidentMeter
from runner.engine.kvcache.resident import NOTHING_OFFLOADED, GrowingLayer, allocated_bytes, next_capacity


class BudgetedDynamicCache(DynamicCache):
    """`expected_tokens` (prompt + new tokens, when known) is allocated at once: no growth, no slack."""

    takes_chunks = True
    """A prompt chunk can ride a decode step as one more row of it (runner/engine/batch_engine.py)."""

    def __init__(
        self, config: PretrainedConfig, device_budget_bytes: int | None = None, expected_tokens: int | None = None,
        device_meter: ResidentMeter | None = None,
    ) -> None:
        super().__init__(config=config)
        self.expected_tokens = expected_tokens
        # DynamicCache maps "full_attention" to exactly DynamicLayer; subclasses (sliding, hybrid) stay
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        self.meter = ResidentMeter(device_budget_bytes, "resident device", "cache.device_kv_budget_bytes", device_meter)
        self.kv = ResidentMeter(None, "valid KV", "")  # the tokens themselves, one slot a layer: `kv_bytes`

    def _held_bytes(self, layers: list[Any] | None = None) -> int:
        """What the layers really allocate: a GrowingLayer's capacity, the others' tensors."""
        return sum(allocated_bytes(layer) for layer in (self.layers if layers is None else layers))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        growing = getattr(layer, "grows", False)
        if not growing:
            arriving = key_states.nbytes + value_states.nbytes
            if not self._fits(self._held_bytes() + arriving):
                self._trim(self.layers)
            self.meter.hold("kv", self._held_bytes() + arriving)
        elif layer.get_seq_length() + key_states.shape[-2] > layer.capacity:
            self._grow(layer, key_states, value_states)
        # else: the new tokens go into room already allocated and counted
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not growing:
            self.meter.hold("kv", self._held_bytes())  # the window may have dropped old tokens
        self.kv.hold(layer_idx, layer.keys.nbytes + layer.values.nbytes)
        return keys, values

    def _grow(self, layer: GrowingLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Geometrically while the budget allows it, else to exactly what is needed (after giving back
        the other layers' unused capacity); raise only if that does not fit."""
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        needed = layer.get_seq_length() + key_states.shape[-2]
        others = [other for other in self.layers if other is not layer]
        held = self._held_bytes(others)
        capacity = next_capacity(layer.capacity, needed)
        if self.expected_tokens is not None and needed <= self.expected_tokens:
            capacity = self.expected_tokens
        if not self._fits(held + layer.bytes_for(capacity)):
            capacity = needed
            if not self._fits(held + layer.bytes_for(needed)):
                self._trim(others)
                held = self._held_bytes(others)
        self.meter.hold("kv", held + layer.bytes_for(capacity))
        layer.grow_to(capacity)

    def _fits(self, nbytes: int) -> bool:
        return self.meter.budget_bytes is None or nbytes <= self.meter.budget_bytes

    @staticmethod
    def _trim(layers: list[Any]) -> None:
        """Give back the growing layers' unused capacity: KV that fits without slack must not be refused."""
        for layer in layers:
            if getattr(layer, "grows", False):
                layer.trim()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """More rows in room already allocated: counted (and checked) now, not at the next growth."""
        super().batch_repeat_interleave(repeats)
        self.meter.hold("kv", self._held_bytes())

    def stats(self) -> dict[str, Any]:
        return {"kv_bytes": self.kv.peak, "kv_resident_peak_bytes": self.meter.peak, **NOTHING_OFFLOADED}

    def close(self) -> None:
        """Give its room in the worker's device pool back; the tensors go with the cache."""
        self.meter.release()

