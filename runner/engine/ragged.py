"""One forward pass over several sequences of different lengths, each with its own KV cache.

A decode step's weight matmuls (projections, MLP, head) cost the same for one row as for many, so
the sequences of a worker share them; attention is each sequence's own (its own cache, its own
length), so nothing is padded and any cache works, tiered ones included. The trick: a
`SequenceBatch` is passed to the model as its `past_key_values`; its `update` hands each row's new
K/V to that row's cache and returns them as `RowGroups`, which the attention function registered
here ("kvbatch-ragged") attends row by row with the model's own attention function. transformers
builds no mask for an attention implementation it has no mask function for, and a decode row needs none.

Rows whose cache is a slot of the worker's KV pool (runner/engine/kvpool.py) go first, in slot
order, as one group: one write and one attention call per layer for all of them
(runner/engine/pooled_attention.py). Tiered rows whose attention is batched (`batch.attention:
pooled`) go next, as a second group: one write and one attention call per streamed layer over
staging slots their layers are read into (runner/engine/tiered_attention.py). The other rows of the
same step stay per row.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runner.engine.kvcache.tiered import TieredCache
from runner.engine.kvpool import PooledCache
from runner.engine.pooled_attention import PooledStep
from runner.engine.tiered_attention import TieredStep

RAGGED = "kvbatch-ragged"


class RowFailed(Exception):
    """A row's cache raised during a batched step: `row` says whose, `__cause__` is the error."""

    def __init__(self, row: int) -> None:
        super().__init__(f"sequence {row} of the batch failed")
        self.row = row


@dataclass
class RowGroups:
    """A layer's keys (or values) for attention: the pooled rows' live slots, the tiered rows' staged
    slots (when the layer is batched for them), then each other row's own."""

    pooled: torch.Tensor | None  # [live slots, kv_heads, span, head_dim]
    rows: list[torch.Tensor]  # per row [1, kv_heads, its length, head_dim]
    step: PooledStep | None = None  # whose write `pooled` is: it attends them
    staged: torch.Tensor | None = None  # [tiered rows, kv_heads, span, head_dim]
    tiered: TieredStep | None = None  # whose write `staged` is


class SequenceBatch:
    """The `past_key_values` of a ragged step: the first `pooled.count` rows are the pool's, the next
    `tiered.count` the tiered step's, row `pooled.count + tiered.count + i` goes to `caches[i]`."""

    def __init__(self, caches: Sequence[Cache], pooled: PooledStep | None = None,
                 tiered: TieredStep | None = None) -> None:
        self.caches = list(caches)
        self.pooled = pooled
        self.tiered = tiered

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[RowGroups, RowGroups]:
        # keys, values: [rows, kv_heads, 1, head_dim]
        first = self.pooled.count if self.pooled else 0
        pooled_keys = pooled_values = None
        if self.pooled:
            pooled_keys, pooled_values = self.pooled.write(layer_idx, keys[:first], values[:first])
        per_row = self.caches
        staged_keys = staged_values = tiered = None
        if self.tiered and self.tiered.batches(layer_idx):
            tiered, end = self.tiered, first + self.tiered.count
            staged_keys, staged_values = self._tiered_update(layer_idx, keys, values, first)
            first = end
        elif self.tiered:
            per_row = self.tiered.caches + self.caches
        out_keys, out_values = [], []
        for row, cache in enumerate(per_row, start=first):
            try:
                k, v = cache.update(keys[row : row + 1], values[row : row + 1], layer_idx)
            except Exception as e:  # noqa: BLE001 - the scheduler fails this row, not its batch-mates
                raise RowFailed(row) from e
            out_keys.append(k)
            out_values.append(v)
        return (RowGroups(pooled_keys, out_keys, self.pooled, staged_keys, tiered),
                RowGroups(pooled_values, out_values, self.pooled, staged_values, tiered))

    def _tiered_update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, first: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tiered rows (rows `first` on) of a layer they all stream: each its own reads, one write."""
        step = self.tiered
        assert step is not None
        keys, values = keys[first : first + step.count], values[first : first + step.count]
        step.prepare(layer_idx, keys)
        outgoing = step.outgoing(keys, values)
        for i in range(step.count):
            try:
                step.take(i, layer_idx, outgoing)
            except Exception as e:  # the scheduler fails this row, not its batch-mates
                raise RowFailed(first + i) from e
        return step.write(layer_idx, outgoing)


def _inner_function(module: torch.nn.Module, implementation: str) -> Any:
    if implementation == "eager":  # a model's own eager attention (Gemma2's has its logit softcap)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [rows, heads, 1, head_dim]
    key: RowGroups,
    value: RowGroups,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The pooled rows in one call, each other row against its own keys, with the model's own attention."""
    inner = _inner_function(module, module.config._kvbatch_inner_attention)
    outputs, first = [], 0
    if key.step is not None:  # the pooled rows' `pooled` views are set with their step
        first = key.step.count
        outputs.append(key.step.attend(inner, module, query[:first], key.pooled, value.pooled, **kwargs))
    if key.tiered is not None:  # set only for a layer the tiered rows all stream
        end = first + key.tiered.count
        outputs.append(key.tiered.attend(inner, module, query[first:end], key.staged, value.staged, **kwargs))
        first = end
    outputs += [inner(module, query[row : row + 1], k, v, None, **kwargs)[0]
                for row, (k, v) in enumerate(zip(key.rows, value.rows), start=first)]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)), None


AttentionInterface.register(RAGGED, ragged_attention)


@contextmanager
def ragged_step(model: PreTrainedModel) -> Iterator[None]:
    """The model attends row by row for one forward pass, then goes back to its own implementation."""
    config = model.config
    own = config._attn_implementation
    config._kvbatch_inner_attention = own
    config._attn_implementation = RAGGED
    try:
        yield
    finally:
        config._attn_implementation = own


def decode_step(model: PreTrainedModel, last_tokens: Sequence[int], positions: Sequence[int],
                caches: Sequence[Cache]) -> torch.Tensor:
    """One decode step for several sequences (each its last token, at its own position, with its own
    cache): the next-token logits, [rows, vocab] in float32, in the order of `caches`."""
    pooled_rows = sorted((row for row, cache in enumerate(caches) if isinstance(cache, PooledCache)),
                         key=lambda row: caches[row].slot)
    tiered_rows = [row for row, cache in enumerate(caches) if isinstance(cache, TieredCache) and cache.batched_attention]
    grouped = set(pooled_rows + tiered_rows)
    order = pooled_rows + tiered_rows + [row for row in range(len(caches)) if row not in grouped]
    pooled = PooledStep(caches[pooled_rows[0]].pool, [caches[row] for row in pooled_rows]) if pooled_rows else None
    tiered = TieredStep([caches[row] for row in tiered_rows]) if tiered_rows else None
    ids = torch.tensor([[last_tokens[row]] for row in order], device=model.device)  # [rows, 1]
    position_ids = torch.tensor([[positions[row]] for row in order], device=model.device)  # [rows, 1]
    batch = SequenceBatch([caches[row] for row in order[len(grouped):]], pooled, tiered)
    try:
        with torch.inference_mode(), ragged_step(model):
            out = model(input_ids=ids, position_ids=position_ids, past_key_values=batch,
                        use_cache=True, logits_to_keep=1)
    except RowFailed as e:  # the row as the caller numbers it
        raise RowFailed(order[e.row]) from e.__cause__
    if pooled:
        pooled.advance()
    logits = out.logits[:, -1, :].float()
    if order == list(range(len(caches))):
        return logits
    return logits[torch.tensor(order, device=logits.device).argsort()]
