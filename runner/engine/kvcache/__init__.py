"""KV cache strategies: transformers' own caches (budget-guarded) and our tiered host/disk cache."""

from runner.engine.kvcache.budget import KVBudgetExceeded, ResidentMeter
from runner.engine.kvcache.dynamic import BudgetedDynamicCache
from runner.engine.kvcache.handle import CacheHandle
from runner.engine.kvcache.resident import GrowingLayer, kv_shape
from runner.engine.kvcache.strategies import (
    build_cache,
    ram_left_by_weights,
    resolve_budgets,
)
from runner.engine.kvcache.tiered import TieredCache

__all__ = [
    "BudgetedDynamicCache",
    "CacheHandle",
    "GrowingLayer",
    "KVBudgetExceeded",
    "ResidentMeter",
    "TieredCache",
    "build_cache",
    "kv_shape",
    "ram_left_by_weights",
    "resolve_budgets",
]
