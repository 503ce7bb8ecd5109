"""One KV pool per worker for the device-resident (`dynamic`) sequences of its batch.

Each pooled sequence is one slot of two buffers, keys and values, each [layers, slots, kv_heads, tokens,
head_dim], so a decode step writes and attends every pooled row with few calls
(runner/engine/pooled_attention.py). Growing means a second pair of buffers beside the first, hence a pool
made once at worker start on CUDA (`planned`). Slots rather than paged blocks, packed live slots, giving way
to a tiered cache and the `generation` captured steps are keyed by: docs/kv-cache.md, "The pooled decode step".
"""

from __future__ import annotations

import weakref
from contextlib import suppress
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from jobs.kvplan import KVShape, kv_bytes
from runner.engine.kvcache.budget import KVBudgetExceeded, ResidentMeter
from runner.engine.kvcache.resident import GRANULE_TOKENS, NOTHING_OFFLOADED, granule, kv_shape, next_capacity

METER_SLOT = "kv-pool"


class KVPool:
    """The worker's pooled KV: `claim` a slot for a sequence, `release` it when the sequence leaves."""

    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device, meter: ResidentMeter,
                 planned: tuple[int, int] | None = None) -> None:
        self.num_layers, self.kv_heads, self.head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        self.dtype, self.device = dtype, device
        self.meter = meter
        self.planned = planned
        """(sequences, tokens) the first claim sizes the pool for, within the budget; None: grow as needed."""
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.owners: list[PooledCache] = []
        """Slot i's sequence; the live slots are 0 .. len(owners) - 1."""
        self.token_bytes = kv_bytes(shape, 1)
        """Keys and values of one token of one slot, all layers."""
        self.generation = 0
        """Buffers made so far: a captured step replays only over the generation it was captured over."""
        self.steps = 0
        """Decode steps run over the pool: what a test or a bench asks to know the pooled path ran."""
        self.most_rows = 0
        """The most rows one pooled step has attended."""
        self.most_runs = 0
        """The most attention calls per layer one pooled step has made (runner/engine/pooled_attention.py runs)."""

    @classmethod
    def for_model(cls, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                  meter: ResidentMeter, planned: tuple[int, int] | None = None) -> KVPool:
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"the KV pool keeps full-attention layers only; this model has {sorted(set(layer_types))}")
        return cls(kv_shape(config, dtype), dtype, device, meter, planned)

    @property
    def slots(self) -> int:
        """Slots allocated (live or free)."""
        return self.keys.shape[1] if self.keys is not None else 0

    @property
    def tokens(self) -> int:
        """Tokens of room in every slot."""
        return self.keys.shape[3] if self.keys is not None else 0

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values of every slot: [slots, kv_heads, tokens, head_dim] views."""
        assert self.keys is not None and self.values is not None, "the pool holds no sequence"
        return self.keys[layer_idx], self.values[layer_idx]

    def fits(self, tokens: int) -> bool:
        """Whether one more sequence of `tokens` can take a slot now: a free one with the room, or new
        buffers within the budget (what admission asks: a claim that does not fit is a memory error,
        which would lower the batch limit)."""
        slots = len(self.owners) + 1
        in_room = slots <= self.slots and tokens <= self.tokens
        return in_room or self.meter.room_for(METER_SLOT, self.bytes_for(*self._least_shape(slots, tokens)))

    def claim(self, cache: PooledCache, tokens: int) -> int:
        """A slot for `cache` with room for `tokens`; raises `KVBudgetExceeded` (a memory error: the
        engine waits for a smaller batch, or the task moves down the ladder) when it does not fit."""
        self.ensure(len(self.owners) + 1, tokens)
        self.owners.append(cache)
        return len(self.owners) - 1

    def reserve(self) -> None:
        """Make a planned pool now (the worker's start), if the budget has room for one slot of the plan."""
        if self.planned is not None and self.keys is None:
            with suppress(KVBudgetExceeded):  # not even one pass of the plan: the claims will say so, task by task
                self.ensure(1, self.planned[1])

    def give_way(self) -> None:
        """Free the buffers of an empty pool (for a tiered cache, which needs the device room)."""
        if not self.owners and self.keys is not None:
            self.keys = self.values = None
            self.meter.drop(METER_SLOT)

    def release(self, cache: PooledCache) -> None:
        """The sequence leaves: the last live slot moves into its place; an empty unplanned pool frees
        its buffers (a planned one is kept for the next)."""
        slot = self.owners.index(cache)
        last = self.owners.pop()
        if last is not cache:
            assert self.keys is not None and self.values is not None
            for buffer in (self.keys, self.values):
                buffer[:, slot, :, : last.length].copy_(buffer[:, len(self.owners), :, : last.length])
            self.owners[slot] = last
            last.slot = slot
        if self.planned is None:
            self.give_way()

    def ensure(self, slots: int, tokens: int) -> None:
        """Room for `slots` sequences of `tokens`: an empty pool with a plan, once for the plan; else
        geometrically; either while the budget allows, else exactly."""
        if slots <= self.slots and tokens <= self.tokens:
            return
        exact = self._least_shape(slots, tokens)
        if self.keys is None and self.planned is not None:
            wanted = self._planned_shape(*exact)
        else:
            wanted = (self.slots if exact[0] <= self.slots else max(exact[0], 2 * self.slots),
                      self.tokens if exact[1] <= self.tokens else next_capacity(self.tokens, exact[1]))
        try:
            self.meter.hold(METER_SLOT, self.bytes_for(*wanted))
            shape = wanted
        except KVBudgetExceeded:
            self.meter.hold(METER_SLOT, self.bytes_for(*exact))  # raises when even that does not fit
            shape = exact
        try:
            self._reallocate(*shape)
        except BaseException:  # a real device OOM: the meter goes back to what the pool still holds
            self.meter.hold(METER_SLOT, self.bytes_for(self.slots, self.tokens))
            raise

    def _least_shape(self, slots: int, tokens: int) -> tuple[int, int]:
        """The smallest buffers that hold `slots` sequences of `tokens` and every live one: what `ensure`
        settles for when the budget has no room for more."""
        return max(slots, len(self.owners)), granule(max([tokens, *(owner.length for owner in self.owners)]))

    def _planned_shape(self, slots: int, tokens: int) -> tuple[int, int]:
        """The plan's shape, at least (`slots`, `tokens`): its slots cut to what the budget has room
        for beside what the meter already holds (the batch's other caches)."""
        assert self.planned is not None
        tokens = max(tokens, granule(self.planned[1]))
        fit = self.planned[0]
        if self.meter.budget_bytes is not None:
            fit = min(fit, (self.meter.budget_bytes - self.meter.total) // self.bytes_for(1, tokens))
        return max(slots, fit), tokens

    def bytes_for(self, slots: int, tokens: int) -> int:
        return slots * tokens * self.token_bytes

    def _reallocate(self, slots: int, tokens: int) -> None:
        shape = (self.num_layers, slots, self.kv_heads, tokens, self.head_dim)
        # zeros, not empty: a row's masked tail is still read, and garbage NaN times a zero weight is NaN
        new = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)]
        if self.keys is not None and self.values is not None and self.owners:
            live, held = len(self.owners), min(self.tokens, tokens)  # a prefill's uncommitted tokens too
            for buffer, old in zip(new, (self.keys, self.values)):
                buffer[:, :live, :, :held].copy_(old[:, :live, :, :held])
        self.keys, self.values = new
        self.generation += 1


class PooledLayer(DynamicLayer):
    """One layer of a pooled sequence: its KV is its slot of the pool's buffers."""

    def __init__(self, cache: PooledCache, layer_idx: int) -> None:
        super().__init__()
        # weakly: with no cycle, a cache its sequence drops is freed at once, not at the next collection
        self.cache, self.layer_idx = weakref.proxy(cache), layer_idx

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill (and a sequence decoding on its own): write into its slot, attend to a view of it."""
        cache = self.cache
        start, end = cache.length, cache.length + key_states.shape[-2]
        cache.pool.ensure(len(cache.pool.owners), end)
        keys, values = cache.pool.layer(self.layer_idx)
        keys[cache.slot, :, start:end].copy_(key_states[0])
        values[cache.slot, :, start:end].copy_(value_states[0])
        if self.layer_idx == cache.pool.num_layers - 1:  # every layer has them: the sequence is longer
            cache.length = end
        self.is_initialized = True
        return keys[cache.slot : cache.slot + 1, :, :end], values[cache.slot : cache.slot + 1, :, :end]

    def get_seq_length(self) -> int:
        return self.cache.length


class PooledCache(Cache):
    """A sequence's cache on the `dynamic` rung when the worker's attention path is pooled."""

    pooled = True
    """Its KV is a slot of `pool`: a decode step attends it with the pool's other rows in one call."""
    takes_chunks = True
    """A prompt chunk can ride a decode step as one more row of it (runner/engine/batch_engine.py)."""

    def __init__(self, pool: KVPool, expected_tokens: int | None) -> None:
        super().__init__(layers=[PooledLayer(self, i) for i in range(pool.num_layers)])
        self.pool = pool
        self.length = 0
        """Tokens every layer holds (committed after the last layer's write)."""
        self.slot = pool.claim(self, expected_tokens or GRANULE_TOKENS)
        self._closed = False
        self._resident_peak = pool.bytes_for(1, pool.tokens)

    def stats(self) -> dict[str, Any]:
        return {
            "kv_bytes": self.length * self.pool.token_bytes,
            "kv_resident_peak_bytes": max(self._resident_peak, self.pool.bytes_for(1, self.pool.tokens)),
            **NOTHING_OFFLOADED,
        }

    def close(self) -> None:
        """Give the slot back (once: a handle may be closed on several paths)."""
        if not self._closed:
            self._closed = True
            self._resident_peak = max(self._resident_peak, self.pool.bytes_for(1, self.pool.tokens))
            self.pool.release(self)
