"""How one pass's cache is made on one rung: a frozen recipe, planned when the pass is handed over.

The worker plans a pass in the task's thread; the engine's thread makes the cache when the pass joins
the batch, and again from the same recipe if a split of the batch starts the pass over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from jobs.config import CacheConfig
from jobs.kvplan import KVShape, Placement, device_kv_bytes, host_kv_bytes, kv_bytes, plan_placement
from jobs.rungs import RUNGS
from runner.engine.kvcache import CacheHandle, ResidentMeter, build_cache
from runner.engine.kvcache.pool import KVPool


@dataclass(frozen=True)
class CacheKit:
    """What every cache a worker makes shares, fixed when the worker starts: the model, the cache
    settings, the budgets, and the meters (and the KV pool) every cache of the batch counts against."""

    model: PreTrainedModel
    settings: CacheConfig
    shape: KVShape
    device_budget: int
    host_budget: int
    device_meter: ResidentMeter
    host_meter: ResidentMeter
    kv_pool: KVPool | None
    device_is_cpu: bool

    def recipe(self, rung: str, tokens: int, offload_dir: Path | None) -> CacheRecipe:
        """The recipe of a pass of `tokens` (prompt + new tokens) on `rung`. On a tiered rung its
        placement says which layers stay on the device; none (every layer streamed) when the whole KV
        would fit the device budget: then the tiered rung is there because the config asked for it
        (`cache.strategy`, or the ladder's order), not for lack of room, and it is honoured as asked."""
        tier = RUNGS[rung].tier
        placement = None
        if tier is not None and kv_bytes(self.shape, tokens) > self.device_budget:
            placement = plan_placement(self.shape, tokens, tier, self.device_budget, self.host_budget,
                                       self.settings.block_tokens, device_is_cpu=self.device_is_cpu)
        return CacheRecipe(self, rung, tokens, placement, offload_dir)


@dataclass(frozen=True)
class CacheRecipe:
    """One pass's cache on one rung; calling it makes a fresh one (the engine's `make_cache`)."""

    kit: CacheKit
    rung: str
    tokens: int
    """Prompt + new tokens: the length the cache is made for."""
    placement: Placement | None
    """The layers a tiered rung keeps on the device (None: every layer streamed, or not tiered)."""
    offload_dir: Path | None
    """The pass's own folder in the task's scratch dir, on a rung that offloads to disk."""

    @property
    def device_bytes(self) -> int:
        """Device memory its KV takes at full length: what the engine's admission sums."""
        return device_kv_bytes(self.kit.shape, self.rung, self.tokens, self.placement)

    @property
    def host_bytes(self) -> int:
        """Host RAM its KV takes at full length (a tiered rung's streamed layers)."""
        return host_kv_bytes(self.kit.shape, self.rung, self.tokens, self.placement, self.kit.settings.block_tokens)

    @property
    def fits(self) -> Callable[[], bool] | None:
        """What admission asks for a pass whose KV is a slot of the worker's pool (`dynamic` with one)."""
        pool = self.kit.kv_pool
        if pool is None or self.rung != "dynamic":
            return None
        return lambda: pool.fits(self.tokens)

    def __call__(self) -> CacheHandle:
        kit = self.kit
        return build_cache(self.rung, kit.model, kit.settings, self.offload_dir, kit.device_budget, kit.host_budget,
                           self.placement, expected_tokens=self.tokens, device_meter=kit.device_meter,
                           host_meter=kit.host_meter, kv_pool=kit.kv_pool)
