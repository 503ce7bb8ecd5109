"""The device budget guard: KV that would not fit raises the same error as a real device OOM.

The worker moves a task to the next cache rung on `torch.OutOfMemoryError`; raising it before allocating
makes the ladder behave the same on the CPU, where nothing else would stop a cache from eating all the RAM.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class KVBudgetExceeded(torch.OutOfMemoryError):
    """Resident KV would exceed the configured budget (a `torch.OutOfMemoryError`, so rungs move on)."""


class ResidentMeter:
    """Bytes a cache holds in one memory, by slot (a layer, a prefetch), with the peak and a limit.

    With a `pool` (the worker's meter of the device or of host RAM, shared by every cache of the
    sequences it batches), each hold also counts against the pool's budget, so the batch as a whole
    stays within the worker's budget, not just each cache alone."""

    def __init__(self, budget_bytes: int | None, what: str, config_key: str,
                 pool: ResidentMeter | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.what = what
        self.config_key = config_key
        self.pool = pool
        self._slots: dict[Hashable, int] = {}
        self.total = 0
        self.peak = 0

    def room_for(self, slot: Hashable, nbytes: int) -> bool:
        """Whether `hold(slot, nbytes)` would fit (this meter's budget and its pool's), holding nothing."""
        total = self.total - self._slots.get(slot, 0) + nbytes
        fits = self.budget_bytes is None or total <= self.budget_bytes
        return fits and (self.pool is None or self.pool.room_for((id(self), slot), nbytes))

    def hold(self, slot: Hashable, nbytes: int) -> None:
        """Set `slot` to `nbytes`, raising `KVBudgetExceeded` first if the total would pass the budget."""
        total = self.total - self._slots.get(slot, 0) + nbytes
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise KVBudgetExceeded(
                f"{self.what} KV would reach {total:,} bytes, over the budget of {self.budget_bytes:,} bytes "
                f"({self.config_key}); the next cache rung (or a shorter context) is needed"
            )
        if self.pool is not None:
            self.pool.hold((id(self), slot), nbytes)
        self._slots[slot] = nbytes
        self.total = total
        self.peak = max(self.peak, total)

    def drop(self, slot: Hashable) -> None:
        self.total -= self._slots.pop(slot, 0)
        if self.pool is not None:
            self.pool.drop((id(self), slot))

    def release(self) -> None:
        """Give every slot back (the cache is closed), to the pool too."""
        for slot in list(self._slots):
            self.drop(slot)
