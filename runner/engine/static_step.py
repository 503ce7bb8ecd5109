"""The pooled decode step with its inputs in static buffers: the form a CUDA graph captures and replays.

A decode step costs the host about 40 eager ops per layer (rotary, norms, the KV write, the mask);
on a GPU the host, not the device, then sets the pace (issue 36: 10 % of the memory-bandwidth bound).
The peers (nano-vllm's and transformers' continuous-batching model runners, vLLM, gpt-fast) pad every
decode step to a batch-size bucket, keep its inputs in static device buffers, capture one CUDA graph
per bucket and replay it. This is that step for kvbatch's KV pool:

- it takes a step whose rows are all the pool's live slots, in slot order (the usual case once the
  prompts are in: no prompt chunk riding, no tiered or per-row caches beside them);
- the rows are padded to a bucket (`BUCKETS`); a padding row is a free slot of the pool, written at
  position 0 and read by nobody (a slot's next owner writes its prompt over it);
- token ids, positions and lengths live in buffers of the bucket's size; the mask is made from the
  lengths inside the step, every row's keys read up to one span (aligned: pooled_attention.py);
- the step ends with each row's logits and its greedy token (argmax), on the device, in static
  outputs: nothing in it reads a value back to the host (tests/test_static_step.py runs it on the
  meta device, where any such read raises);
- on CUDA, each (bucket, span) is captured once and replayed (`graphs`); a grown pool (new buffers)
  drops the graphs. On the CPU the same step runs eagerly and gives today's tokens.

The caller reads the step's tokens (or chooses from its logits) after it: one transfer a step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.pooled_attention import SPAN_GRANULE, PooledStep, aligned, length_mask
from runner.engine.ragged import SequenceBatch, ragged_step
from runner.engine.step_inputs import step_inputs

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))
"""Rows a step is padded to (nano-vllm's): each is one graph per span."""
GRAPH_SPAN_TOKENS = 4 * SPAN_GRANULE
"""A captured step's span is a multiple of this: a graph per 256 tokens of the longest row, not per 64."""


def bucket(rows: int) -> int:
    """The smallest bucket that holds `rows`."""
    return next(size for size in BUCKETS if size >= rows)


class _StaticRows(PooledStep):
    """The pooled rows of one static step (`SequenceBatch`'s `pooled`): a bucket's buffers, every row
    read up to `span` in one call, the mask made on the device from the buffers' lengths."""

    def __init__(self, pool: KVPool, buffers: _Buffers, span: int) -> None:  # not super().__init__: that one reads host lists
        self.pool, self.caches, self.count, self.live, self.span = pool, [], buffers.rows, buffers.rows, span
        self.packed = True
        self.slots, self.positions = buffers.slots, buffers.positions
        self.mask = length_mask(buffers.lengths, span, pool.dtype, pool.device, "pooled lengths")
        self.runs = [(0, self.count, span)]


class _Buffers:
    """A bucket's static inputs and outputs on the device."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.slots = torch.arange(rows, device=device)  # row i is slot i: the step's rows are the live slots
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)  # attended tokens, the new one included
        self.logits: torch.Tensor | None = None  # [rows, vocab] float32, made by the first run
        self.tokens: torch.Tensor | None = None  # [rows] each row's greedy token


class StaticStep:
    """The worker's static decode steps over `pool`; `graphs`: capture and replay them (CUDA only)."""

    def __init__(self, model: PreTrainedModel, pool: KVPool, graphs: bool) -> None:
        self.model, self.pool = model, pool
        self.graphs = graphs and pool.device.type == "cuda"
        self._buffers: dict[int, _Buffers] = {}
        self._captured: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._captured_for: int | None = None  # the pool buffers the graphs write (their data_ptr)
        self._graph_pool: Any = None
        self.steps = 0
        """Steps run here: what a test asks to know this path ran."""
        self.buckets_run: set[int] = set()
        self.captures = 0

    def takes(self, caches: Sequence[Any]) -> bool:
        """Whether a step of these rows is a static one: they are the pool's live slots and nothing else,
        and the pool has a free slot for each padding row of their bucket."""
        owners = self.pool.owners
        return (0 < len(caches) == len(owners) and bucket(len(caches)) <= self.pool.slots
                and all(isinstance(c, PooledCache) for c in caches)
                and all(c is owner for c, owner in zip(sorted(caches, key=lambda c: c.slot), owners)))

    def run(self, last_tokens: Sequence[int], caches: Sequence[PooledCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of `caches` (their last tokens in the same order): each row's logits
        ([rows, vocab] float32) and greedy token ([rows]), on the device, in the order of `caches`.
        Nothing here waits on the device."""
        order = sorted(range(len(caches)), key=lambda row: caches[row].slot)
        size = bucket(len(caches))
        lengths = [caches[row].length for row in order]
        span = aligned(max(lengths) + 1)
        if self.graphs:  # fewer shapes to capture, within the pool's room
            span = max(span, min(-(-span // GRAPH_SPAN_TOKENS) * GRAPH_SPAN_TOKENS, self.pool.tokens))
        self.pool.ensure(len(self.pool.owners), span)
        buffers = self._buffers.get(size)
        if buffers is None:
            buffers = self._buffers[size] = _Buffers(size, self.pool.device)
        padding = size - len(caches)
        inputs = step_inputs(self.pool.device)
        buffers.ids.copy_(inputs.put("ids", [last_tokens[row] for row in order] + [0] * padding), non_blocking=True)
        buffers.positions.copy_(inputs.put("positions", lengths + [0] * padding), non_blocking=True)
        buffers.lengths.copy_(inputs.put("pooled lengths", [n + 1 for n in lengths] + [1] * padding), non_blocking=True)
        if self.graphs:
            self._replay(buffers, span)
        else:
            self._forward(buffers, span)
        for cache in caches:
            cache.length += 1
        self.steps += 1
        self.buckets_run.add(size)
        self.pool.steps += 1
        self.pool.most_rows = max(self.pool.most_rows, len(caches))
        assert buffers.logits is not None and buffers.tokens is not None
        back = inputs.put("order", order).argsort() if order != sorted(order) else None
        logits, tokens = buffers.logits[: len(caches)], buffers.tokens[: len(caches)]
        return (logits, tokens) if back is None else (logits[back], tokens[back])

    def _forward(self, buffers: _Buffers, span: int) -> None:
        """The step itself, from the buffers to the outputs: what a graph captures."""
        rows = _StaticRows(self.pool, buffers, span)
        with torch.inference_mode(), ragged_step(self.model):
            out = self.model(input_ids=buffers.ids[None], position_ids=buffers.positions[None],
                             past_key_values=SequenceBatch([], pooled=rows), use_cache=True, logits_to_keep=0)
        logits = out.logits[0].float()  # [rows, vocab]
        if buffers.logits is None or buffers.logits.shape != logits.shape:
            buffers.logits = torch.empty_like(logits)
            buffers.tokens = torch.empty(buffers.rows, dtype=torch.long, device=logits.device)
        buffers.logits.copy_(logits)
        torch.argmax(logits, dim=-1, out=buffers.tokens)

    def _replay(self, buffers: _Buffers, span: int) -> None:
        """The captured step of this bucket and span (captured now if it is new; a pool that was made
        again drops the graphs, which wrote its old buffers)."""
        assert self.pool.keys is not None
        if self._captured_for != self.pool.keys.data_ptr():
            self._captured.clear()
            self._captured_for = self.pool.keys.data_ptr()
        key = (buffers.rows, span)
        graph = self._captured.get(key)
        if graph is None:
            graph = self._capture(buffers, span)
        graph.replay()

    def _capture(self, buffers: _Buffers, span: int) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream (allocator and kernels' first-run work), then capture it.
        The warm-up and the capture write the padding rows' KV at their positions: slots nobody reads
        at positions the real rows' writes repeat with the same values."""
        stream = torch.cuda.Stream(self.pool.device)
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            self._forward(buffers, span)
        torch.cuda.current_stream(self.pool.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._forward(buffers, span)
        self._captured[buffers.rows, span] = graph
        self.captures += 1
        log.info("captured the decode step for %d rows up to %d tokens", buffers.rows, span)
        return graph
