"""The pooled rows of one decode step: one K/V write and few attention calls per layer for all of them.

Built once per step (runner/engine/ragged.py `decode_step`): the slots and positions the rows write to,
an additive length mask over the pool's live slots (each row attends to its own tokens only), and the
runs the live slots are attended in. Rows are ordered by slot, so when they are all the live slots
(the usual case) the queries are the pool's rows as they are; otherwise they are scattered and gathered.

Runs: one call over all live slots reads every slot up to the longest row, so short rows beside a long
one read masked padding (what a varlen kernel skips). The live slots are cut, in slot order, into at
most `MOST_RUNS` contiguous runs where a cut saves enough reads (`attention_runs`); slots run roughly
from the oldest rows to the newest, so the cuts need no reordering (no copy) of the pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.step_inputs import step_inputs

SPAN_GRANULE = 64
"""Every decode attention call reads keys in spans of a multiple of this many tokens, masked past each
row's own length (`aligned`). Why: SDPA kernels round a row's sums by the span they are given (the
CPU's vectorised sums split a span that is not a multiple of their width differently), so a row read
up to its own length alone and up to a longer batch-mate's in a batch came out different in bf16;
over aligned spans the masked tail adds exact zeros, and a row's output is the same whatever the span
(tests/test_batch_invariance.py). Aligned spans also start every row's slice of a mask on a 128-byte
boundary (cuDNN faulted on an odd span's) and give a kernel a few shapes per job, not one per step."""
MOST_RUNS = 4
"""Attention calls per layer at most for the pooled rows."""
RUN_TOKENS = 1024
"""What a call more must save in reads, in token-rows (rows x tokens): an attention call costs a
launch and a fixed setup, which a handful of padded tokens does not repay."""


def aligned(tokens: int) -> int:
    """`tokens` rounded up to the span granule: what an attention call over them reads."""
    return -(-tokens // SPAN_GRANULE) * SPAN_GRANULE


def length_mask(attended: Sequence[int] | torch.Tensor, span: int, dtype: torch.dtype, device: torch.device,
                kind: str) -> torch.Tensor:
    """The additive mask [rows, 1, 1, span] that lets row i attend to its first `attended[i]` tokens
    (`kind`: the step input host lengths go to the device as, runner/engine/step_inputs.py; lengths
    already on the device, as a static step keeps them, are used as they are)."""
    lengths = attended if isinstance(attended, torch.Tensor) else step_inputs(device).put(kind, attended)
    valid = torch.arange(span, device=device) < lengths[:, None]
    return torch.zeros((len(lengths), 1, 1, span), dtype=dtype, device=device).masked_fill_(
        ~valid[:, None, None, :], torch.finfo(dtype).min)


def attention_runs(attended: Sequence[int], most: int = MOST_RUNS) -> list[tuple[int, int, int]]:
    """The live slots (slot i attends its first `attended[i]` tokens) as runs `(start, end, span)`:
    slots start..end-1 attended in one call up to `span`, the run's longest. The cut into at most
    `most` contiguous runs that reads the fewest token-rows, each run after the first charged
    `RUN_TOKENS` (a dynamic programme over the cuts, skipped when the padding could not pay for one)."""
    count, longest = len(attended), max(attended)
    if count * longest - sum(attended) < RUN_TOKENS:
        return [(0, count, longest)]
    # reads[k][end]: the fewest token-rows slots 0..end-1 read in k runs; first[k][end]: where the last starts
    reads = [[math.inf] * (count + 1) for _ in range(most + 1)]
    first = [[0] * (count + 1) for _ in range(most + 1)]
    reads[0][0] = 0
    for k in range(1, most + 1):
        for end in range(k, count + 1) if k < most else (count,):  # the last k: all the slots only
            span = 0
            for start in range(end - 1, k - 2, -1):
                span = max(span, attended[start])
                total = reads[k - 1][start] + (end - start) * span
                if total < reads[k][end]:
                    reads[k][end], first[k][end] = total, start
    runs_count = min(range(1, most + 1), key=lambda k: reads[k][count] + RUN_TOKENS * (k - 1))
    runs, end = [], count
    for k in range(runs_count, 0, -1):
        start = first[k][end]
        runs.append((start, end, max(attended[start:end])))
        end = start
    return runs[::-1]


class PooledStep:
    """`caches` are the step's pooled rows, in the step's row order (ascending slots)."""

    def __init__(self, pool: KVPool, caches: Sequence[PooledCache]) -> None:
        assert all(cache.pool is pool for cache in caches), "a step's pooled rows are slots of one pool"
        self.pool = pool
        self.caches = list(caches)
        self.count = len(caches)
        lengths = [cache.length for cache in caches]
        self.span = aligned(max(lengths) + 1)  # the longest row's tokens, its new one included, aligned
        pool.ensure(len(pool.owners), self.span)
        self.live = len(pool.owners)
        slots = [cache.slot for cache in caches]
        self.packed = slots == list(range(self.live))
        inputs = step_inputs(pool.device)
        self.slots = inputs.put("pooled slots", slots)
        self.positions = inputs.put("pooled positions", lengths)
        attended = [1] * self.live  # a slot without a row in this step: any non-empty length, its output is dropped
        for slot, length in zip(slots, lengths):
            attended[slot] = length + 1
        self.mask = length_mask(attended, self.span, pool.dtype, pool.device, "pooled lengths")
        self.runs = [(start, end, aligned(span)) for start, end, span in attention_runs(attended)]
        pool.steps += 1
        pool.most_rows = max(pool.most_rows, self.count)
        pool.most_runs = max(pool.most_runs, len(self.runs))

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' new K/V ([rows, kv_heads, 1, head_dim]) into their slots; the live slots' K/V."""
        pool_keys, pool_values = self.pool.layer(layer_idx)
        pool_keys[self.slots, :, self.positions] = keys[:, :, 0]  # one index_put_ each
        pool_values[self.slots, :, self.positions] = values[:, :, 0]
        return pool_keys[: self.live, :, : self.span], pool_values[: self.live, :, : self.span]

    def attend(self, inner: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The model's attention over the live slots, one call per run; the rows' outputs, in row order."""
        if not self.packed:
            query = query.new_zeros((self.live, *query.shape[1:])).index_copy_(0, self.slots, query)
        if len(self.runs) == 1:  # the views as they are: no slicing ops
            out = inner(module, query, key, value, self.mask, **kwargs)[0]
        else:
            out = torch.cat([inner(module, query[start:end], key[start:end, :, :span], value[start:end, :, :span],
                                   self.mask[start:end, :, :, :span], **kwargs)[0] for start, end, span in self.runs])
        return out if self.packed else out.index_select(0, self.slots)

    def advance(self) -> None:
        """After the forward pass: every row holds one token more."""
        for cache in self.caches:
            cache.length += 1
