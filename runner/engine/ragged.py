"""One forward pass over several sequences of different lengths, each with its own KV cache.

A `SequenceBatch` is passed to the model as its `past_key_values`; its `update` hands each row's new K/V
to that row's cache and returns them as `RowGroups`, which the attention function registered here
("kvbatch-ragged") attends (transformers builds no mask for it, and a decode row needs none). Row order
in a step: pool rows in slot order, tiered rows, per-row rows, then one riding `PrefillChunk` with
generate()'s chunked-prefill causal mask; all packed into one input row ([1, tokens]).
Why and what it costs: docs/kv-cache.md, "Batched decode steps".
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runner.engine.pooled_attention import PooledStep, aligned, length_mask
from runner.engine.step_inputs import step_inputs
from runner.engine.tiered_attention import TieredRowFailed, TieredStep

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
    chunk: PrefillChunk | None = None  # the last of `rows` is this chunk's, several tokens


@dataclass
class PrefillChunk:
    """Prompt tokens of a joining sequence that ride a step: `tokens` at positions `start` onwards."""

    cache: Cache
    tokens: list[int]
    start: int
    wants_logits: bool
    """Whether its last position's logits are wanted (the prompt's last chunk: the first token)."""
    mask: torch.Tensor | None = field(default=None, init=False)

    def causal_mask(self, query: torch.Tensor, implementation: str) -> torch.Tensor | None:
        """The mask generate()'s chunked prefill gives this chunk ([1, 1, chunk, start + chunk]): SDPA's
        boolean one (None for a first chunk: SDPA is causal by itself), an additive one for eager."""
        if self.mask is None and not (implementation == "sdpa" and self.start == 0):
            n = len(self.tokens)
            seen = torch.arange(self.start + n, device=query.device) <= (
                self.start + torch.arange(n, device=query.device))[:, None]  # [chunk, start + chunk]
            if implementation == "sdpa":
                self.mask = seen[None, None]
            else:
                self.mask = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill_(
                    ~seen, torch.finfo(query.dtype).min)[None, None]
        return self.mask


@dataclass(eq=False)
class SequenceBatch:
    """The `past_key_values` of a ragged step: the first `pooled.count` tokens are the pool's rows, the
    next `tiered.count` the tiered step's, the next ones go to `caches[i]` one token each, and a
    chunk's tokens, last, to `chunk.cache`."""

    caches: list[Cache]
    pooled: PooledStep | None = None
    tiered: TieredStep | None = None
    chunk: PrefillChunk | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[RowGroups, RowGroups]:
        # keys, values: [1, kv_heads, step tokens, head_dim]
        first = self.pooled.count if self.pooled else 0
        pooled_keys = pooled_values = None
        if self.pooled:
            pooled_keys, pooled_values = self.pooled.write(layer_idx, _rows(keys, 0, first), _rows(values, 0, first))
        per_row = self.caches
        staged_keys = staged_values = tiered = None
        if self.tiered and self.tiered.batches(layer_idx):
            tiered, end = self.tiered, first + self.tiered.count
            staged_keys, staged_values = self._tiered_update(layer_idx, keys, values, first)
            first = end
        elif self.tiered:
            per_row = self.tiered.caches + self.caches
        out_keys, out_values = [], []
        rows = [(cache, 1) for cache in per_row] + ([(self.chunk.cache, len(self.chunk.tokens))] if self.chunk else [])
        for row, (cache, length) in enumerate(rows, start=first):  # one token a row but the chunk, last: row = start
            try:
                k, v = cache.update(keys[:, :, row : row + length], values[:, :, row : row + length], layer_idx)
            except Exception as e:  # the engine fails this row, not its batch-mates
                raise RowFailed(row) from e
            out_keys.append(k)
            out_values.append(v)
        return (RowGroups(pooled_keys, out_keys, self.pooled, staged_keys, tiered, self.chunk),
                RowGroups(pooled_values, out_values, self.pooled, staged_values, tiered, self.chunk))

    def _tiered_update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, first: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tiered rows (rows `first` on) of a layer they all stream: one read job, one write."""
        step = self.tiered
        assert step is not None
        keys, values = _rows(keys, first, first + step.count), _rows(values, first, first + step.count)
        step.prepare(layer_idx, keys)
        outgoing = step.outgoing(keys, values)
        try:
            step.take(layer_idx, outgoing)
        except TieredRowFailed as e:  # the engine fails this row, not its batch-mates
            raise RowFailed(first + e.row) from e.__cause__
        return step.write(layer_idx, outgoing)


def _rows(states: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens `start:end` of a packed step ([1, heads, tokens, head_dim]) as one-token rows: [rows, heads, 1, head_dim]."""
    return states[0, :, start:end].transpose(0, 1).unsqueeze(2)


def _aligned_row(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode row's own K/V ([1, kv_heads, length, head_dim]) padded to an aligned span, with the mask
    of its length: what the pooled rows attend, so a row's tokens do not depend on the path it takes."""
    length = keys.shape[-2]
    span = aligned(length)
    if span > length:
        keys, values = (F.pad(states, (0, 0, 0, span - length)) for states in (keys, values))
    return keys, values, _row_mask(length, span, keys.dtype, keys.device)


@functools.lru_cache(maxsize=256)
def _row_mask(length: int, span: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A decode row's length mask, made once for all the layers of its step (attention only reads it)."""
    return length_mask([length], span, dtype, device, "row length")


def _inner_function(module: torch.nn.Module, implementation: str) -> Any:
    if implementation == "eager":  # a model's own eager attention (Gemma2's has its logit softcap)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, step tokens, head_dim]
    key: RowGroups,
    value: RowGroups,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The pooled rows in one call, each other row against its own keys, with the model's own attention:
    the output [1, step tokens, heads, head_dim]."""
    implementation = module.config._kvbatch_inner_attention
    inner = _inner_function(module, implementation)
    outputs, first = [], 0
    if key.step is not None:  # the pooled rows' `pooled` views are set with their step
        first = key.step.count
        pooled = key.step.attend(inner, module, _rows(query, 0, first), key.pooled, value.pooled, **kwargs)
        outputs.append(pooled.transpose(0, 1))  # [rows, 1, heads, head_dim] -> [1, rows, heads, head_dim]
    if key.tiered is not None:  # set only for a layer the tiered rows all stream
        end = first + key.tiered.count
        staged = key.tiered.attend(inner, module, _rows(query, first, end), key.staged, value.staged, **kwargs)
        outputs.append(staged.transpose(0, 1))
        first = end
    chunk_row = first + len(key.rows) - 1 if key.chunk is not None else None
    for row, (k, v) in enumerate(zip(key.rows, value.rows), start=first):  # one token a row but the chunk, last
        if row == chunk_row:
            q = query[:, :, row:]
            outputs.append(inner(module, q, k, v, key.chunk.causal_mask(q, implementation), **kwargs)[0])
        else:
            if implementation in MASKED_ATTENTION:  # masks it takes: the pooled rows' computation (batch-invariant)
                k, v, mask = _aligned_row(k, v)
            else:
                mask = None
            outputs.append(inner(module, query[:, :, row : row + 1], k, v, mask, **kwargs)[0])
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


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


MASKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take kvbatch's masks: a chunk row's causal one (`PrefillChunk.causal_mask`),
a decode row's length one (`_aligned_row`)."""


def decode_step(model: PreTrainedModel, last_tokens: Sequence[int], positions: Sequence[int],
                caches: Sequence[Cache]) -> torch.Tensor:
    """One decode step for several sequences (each its last token, at its own position, with its own
    cache): the next-token logits, [rows, vocab] in float32, in the order of `caches`."""
    return mixed_step(model, last_tokens, positions, caches, None)[0]


def mixed_step(model: PreTrainedModel, last_tokens: Sequence[int], positions: Sequence[int],
               caches: Sequence[Cache], chunk: PrefillChunk | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass: a decode step for the rows of `caches`, and `chunk`'s prompt tokens beside
    them (its row is `len(caches)` in a `RowFailed`). The decode rows' next-token logits ([rows, vocab]
    float32, in the order of `caches`) and, when the chunk wants them, its last position's ([1, vocab])."""
    pooled_rows = sorted((row for row, cache in enumerate(caches) if getattr(cache, "pooled", False)),
                         key=lambda row: caches[row].slot)
    tiered_rows = [row for row, cache in enumerate(caches) if getattr(cache, "batched_attention", False)]
    grouped = set(pooled_rows + tiered_rows)
    order = pooled_rows + tiered_rows + [row for row in range(len(caches)) if row not in grouped]
    if chunk is not None and getattr(chunk.cache, "pooled", False):  # its room before the step's views are cut
        chunk.cache.pool.ensure(len(chunk.cache.pool.owners), chunk.start + len(chunk.tokens))
    pooled = PooledStep(caches[pooled_rows[0]].pool, [caches[row] for row in pooled_rows]) if pooled_rows else None
    tiered = TieredStep([caches[row] for row in tiered_rows]) if tiered_rows else None
    tokens = [last_tokens[row] for row in order]
    token_positions = [positions[row] for row in order]
    if chunk is not None:
        tokens += chunk.tokens
        token_positions += range(chunk.start, chunk.start + len(chunk.tokens))
    inputs = step_inputs(model.device)
    ids = inputs.put("ids", tokens)[None]  # [1, step tokens]
    position_ids = inputs.put("positions", token_positions)[None]  # [1, step tokens]
    keep = list(range(len(order))) + ([len(tokens) - 1] if chunk is not None and chunk.wants_logits else [])
    batch = SequenceBatch([caches[row] for row in order[len(grouped):]], pooled, tiered, chunk)
    try:
        with torch.inference_mode(), ragged_step(model):
            out = model(input_ids=ids, position_ids=position_ids, past_key_values=batch, use_cache=True,
                        logits_to_keep=0 if chunk is None else inputs.put("kept", keep))
    except RowFailed as e:  # the row as the caller numbers it
        raise RowFailed(order[e.row] if e.row < len(order) else len(caches)) from e.__cause__
    if pooled:
        pooled.advance()
    logits = out.logits[0].float()  # [kept, vocab]
    chunk_logits = logits[len(order) :] if chunk is not None and chunk.wants_logits else None
    logits = logits[: len(order)]
    if order != list(range(len(caches))):
        logits = logits[inputs.put("order", order).argsort()]
    return logits, chunk_logits
