"""`dynamic` with the budget guard: transformers' DynamicCache that refuses to outgrow a device budget.

Every layer stays on the device, so resident KV is all of it; checking before each update lets the
planner's ladder be exercised on CPU exactly as a real CUDA OOM would on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache

from runner.kvcache.budget import ResidentMeter


class BudgetedDynamicCache(DynamicCache):
    def __init__(self, config: PretrainedConfig, device_budget_bytes: int | None = None) -> None:
        super().__init__(config=config)
        self.meter = ResidentMeter(device_budget_bytes, "resident device", "cache.device_kv_budget_bytes")

    def _held_bytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in self.layers
            if getattr(layer, "keys", None) is not None
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.meter.hold("kv", self._held_bytes() + key_states.nbytes + value_states.nbytes)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.meter.hold("kv", self._held_bytes())  # sliding layers may have dropped old tokens
        return keys, values

    def stats(self) -> dict[str, Any]:
        return {
            "kv_bytes": self.meter.peak,
            "kv_resident_peak_bytes": self.meter.peak,
            "offload_bytes_written": 0,
            "offload_bytes_read": 0,
            "compression_ratio": None,
        }

    def close(self) -> None:
        """Nothing to release beyond the tensors themselves (kept for the CacheHandle protocol)."""
