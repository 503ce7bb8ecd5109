"""The pooled rows of one decode step: one K/V write and one attention call per layer for all of them.

Built once per step (runner/engine/ragged.py `decode_step`), before the forward pass: the slots and
positions the rows write to, and the additive length mask over the pool's live slots that lets each
row attend to its own tokens only. Per layer, `write` puts every row's new K/V into the pool with one
indexed write each and hands attention a view of the live slots; `attend` runs the model's own
attention implementation once over that view. The step's rows are ordered by slot, so when they are
all the pool's live slots (the usual case) the queries are the pool's rows as they are; otherwise
they are scattered to their slots and gathered back, one op each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from runner.engine.kvpool import KVPool, PooledCache


def length_mask(attended: Sequence[int], span: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask [rows, 1, 1, span] that lets row i attend to its first `attended[i]` tokens."""
    valid = torch.arange(span, device=device) < torch.tensor(attended, device=device)[:, None]
    return torch.zeros((len(attended), 1, 1, span), dtype=dtype, device=device).masked_fill_(
        ~valid[:, None, None, :], torch.finfo(dtype).min)


class PooledStep:
    """`caches` are the step's pooled rows, in the step's row order (ascending slots)."""

    def __init__(self, pool: KVPool, caches: Sequence[PooledCache]) -> None:
        assert all(cache.pool is pool for cache in caches), "a step's pooled rows are slots of one pool"
        self.pool = pool
        self.caches = list(caches)
        self.count = len(caches)
        lengths = [cache.length for cache in caches]
        self.span = max(lengths) + 1  # tokens the longest row attends to, its new one included
        pool.ensure(len(pool.owners), self.span)
        live = len(pool.owners)
        slots = [cache.slot for cache in caches]
        self.live = live
        self.packed = slots == list(range(live))
        device = pool.device
        self.slots = torch.tensor(slots, device=device)
        self.positions = torch.tensor(lengths, device=device)
        attended = [1] * live  # a slot without a row in this step: any non-empty length, its output is dropped
        for slot, length in zip(slots, lengths):
            attended[slot] = length + 1
        self.mask = length_mask(attended, self.span, pool.dtype, device)
        pool.steps += 1
        pool.most_rows = max(pool.most_rows, self.count)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' new K/V ([rows, kv_heads, 1, head_dim]) into their slots; the live slots' K/V."""
        pool_keys, pool_values = self.pool.layer(layer_idx)
        pool_keys[self.slots, :, self.positions] = keys[:, :, 0]  # one index_put_ each
        pool_values[self.slots, :, self.positions] = values[:, :, 0]
        return pool_keys[: self.live, :, : self.span], pool_values[: self.live, :, : self.span]

    def attend(self, inner: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor | None, value: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        """One call of the model's attention over the live slots; the rows' outputs, in row order."""
        if not self.packed:
            query = query.new_zeros((self.live, *query.shape[1:])).index_copy_(0, self.slots, query)
        out = inner(module, query, key, value, self.mask, **kwargs)[0]
        return out if self.packed else out.index_select(0, self.slots)

    def advance(self) -> None:
        """After the forward pass: every row holds one token more."""
        for cache in self.caches:
            cache.length += 1
