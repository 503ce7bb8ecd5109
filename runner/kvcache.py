"""The public KV-cache API for people who call transformers themselves (`from runner.engine.kvcache import
TieredCache`); the caches live in runner/engine/kvcache/."""

from runner.engine.kvcache import (
    BudgetedDynamicCache,
    GrowingLayer,
    KVBudgetExceeded,
    TieredCache,
)

__all__ = ["BudgetedDynamicCache", "GrowingLayer", "KVBudgetExceeded", "TieredCache"]
