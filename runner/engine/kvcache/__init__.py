"""KV cache strategies: transformers' own caches (budget-guarded) and our tiered host/disk cache."""

from runner.kvcache.budget import KVBudgetExceeded
from runner.kvcache.dynamic import BudgetedDynamicCache
from runner.kvcache.resident import GrowingLayer
from runner.kvcache.strategies import CacheHandle, build_cache, kv_shape, resolve_budgets
from runner.kvcache.tiered import TieredCache

__all__ = [
    "BudgetedDynamicCache",
    "CacheHandle",
    "GrowingLayer",
    "KVBudgetExceeded",
    "TieredCache",
    "build_cache",
    "kv_shape",
    "resolve_budgets",
]
