"""What one sequence gets from its cache rung: the cache it decodes into, its stats, its cleanup.

A sequence whose rung is one of transformers' own `cache_implementation` values runs alone (`cache` is
None): `generate()` builds that cache, so it cannot decode beside batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from transformers.cache_utils import Cache

from jobs.outcome import CacheStats


@dataclass
class CacheHandle:
    """One sequence's cache on one rung."""

    strategy: str
    cache: Cache | None
    """The cache the rung built, which the sequence prefills and decodes into within its batch;
    None on a `cache_implementation` rung, where `generate()` builds the cache and runs it alone."""

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        """What `generate()` takes to use this cache."""
        if self.cache is None:
            return {"cache_implementation": self.strategy}
        return {"past_key_values": self.cache}

    def stats(self) -> CacheStats:
        """The result row's cache columns (None where the strategy cannot tell)."""
        raw = self.cache.stats() if self.cache is not None else {}
        return CacheStats(**{key: raw.get(key) for key in CacheStats.__annotations__})

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
