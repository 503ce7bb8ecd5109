"""The tiered rows of one decode step: one K/V write and one attention call per streamed layer for all of them.

Rather than its own buffers, write and attention call per row, the step's tiered rows (whose streamed
layers come to the device for their turn, runner/engine/kvcache/tiered.py) share two staging buffers,
[2, rows, kv_heads, span, head_dim], used by alternate layers: one job on the first row's IO thread
reads the next layer for every row into one while the layer before attends over the other. Each row
attends to its own length through an additive mask, as the pooled rows do (pooled_attention.py); what
a view covers past a row's length is finite KV an earlier step left, weighed at exactly zero.

The buffers are kept across steps (one pair per worker thread, device and KV shape, while an open
tiered row holds it), so a step allocates nothing; the per-row copies are one `_foreach_copy_` each
way. A layer any row keeps on the device or as a sliding window goes row by row
(`TieredCache.streams`). docs/kv-cache.md, "Batched decode steps", has the rest.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from runner.engine.kvcache.layer_store import Read, Slot, StagingBuffers, copy_all, read_all
from runner.engine.kvcache.tiered import TieredCache
from runner.engine.pooled_attention import aligned, length_mask
from runner.engine.step_inputs import step_inputs

T = TypeVar("T")
_PER_THREAD = threading.local()


class TieredRowFailed(Exception):
    """Tiered row `row` of the step (its number among the step's tiered rows) failed; `__cause__`
    is its cache's error."""

    def __init__(self, row: int) -> None:
        super().__init__(f"tiered row {row} of the step failed")
        self.row = row


class TieredStep:
    """`caches` are the step's tiered rows, in the step's row order."""

    def __init__(self, caches: Sequence[TieredCache]) -> None:
        self.caches = list(caches)
        self.count = len(caches)
        self.lengths: list[int] = []
        self.span = 0
        self.staged: list[torch.Tensor] = []  # the two staging buffers, by layer parity: [2 (keys, values), rows, ...]
        self.slots: list[list[Slot]] = []  # [parity][row]: views of the staging buffers
        self.mask: torch.Tensor | None = None
        self._following: list[Slot] = []
        self._reading: tuple[Future[None], list[Read]] | None = None  # the read job queued last, and its reads
        self._rows: torch.Tensor | None = None  # 0 .. rows - 1, and each row's position: where `write` puts them
        self._positions: torch.Tensor | None = None

    def batches(self, layer_idx: int) -> bool:
        """Whether every tiered row streams layer `layer_idx` (else the layer goes row by row)."""
        return all(cache.streams(layer_idx) for cache in self.caches)

    def prepare(self, layer_idx: int, like: torch.Tensor) -> None:
        """Before the rows' `take`s of layer `layer_idx`: staging buffers and mask for the rows'
        lengths (the same at every layer of a step), and the slots the next layer is read into."""
        self._shape([cache.layers[layer_idx].store.seq_len for cache in self.caches], like)
        following = self.slots[1 - layer_idx % 2]
        if like.is_cuda:  # that buffer's last reader (the layer before) is queued by now: its reads wait for it
            free = torch.cuda.current_stream(like.device).record_event()
            following = [dataclasses.replace(slot, free=free) for slot in following]
        self._following = following

    def _shape(self, lengths: list[int], like: torch.Tensor) -> None:
        if lengths == self.lengths:
            return
        self.lengths, self.span = lengths, aligned(max(lengths) + 1)
        # this thread's staging buffers for KV like `like`, held by the rows: they live while one of
        # them is open, and the next step of them (or of rows joining them) reuses them
        kept: weakref.WeakValueDictionary[tuple[Any, ...], StagingBuffers] = _PER_THREAD.__dict__.setdefault(
            "staging", weakref.WeakValueDictionary())
        key = (like.device, like.dtype, like.shape[1], like.shape[3])
        staging = kept.get(key)
        if staging is None:
            staging = kept[key] = StagingBuffers(like.shape[1], like.shape[3], like.dtype, like.device)
        for cache in self.caches:
            cache.staging = staging
        self.staged = staging.views(self.count, self.span)
        held = max(lengths) + 1  # a row's slot (what its reads fill and its meter holds): the rest is masked padding
        self.slots = [[Slot.over(staged[:, row : row + 1, :, :held]) for row in range(self.count)]
                      for staged in self.staged]
        self.mask = length_mask([n + 1 for n in lengths], self.span, like.dtype, like.device, "tiered lengths")
        self._rows = torch.arange(self.count, device=like.device)
        self._positions = step_inputs(like.device).put("tiered positions", lengths)

    def outgoing(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Every row's new K/V ([rows, kv_heads, 1, head_dim] each) stacked as the tails hold a token
        ([rows, 2, kv_heads, head_dim]): one op, so each row's copy to its tail is one contiguous copy."""
        return torch.stack((keys[:, :, 0], values[:, :, 0]), dim=1)

    def take(self, layer_idx: int, outgoing: torch.Tensor) -> None:
        """Every row's old tokens of the layer in its slot, its new one (its row of `outgoing`) to its
        tier, one copy for all rows each way; the next layer read ahead for every row in one job."""
        slots = self.slots[layer_idx % 2]
        waited = self._settle_reads() / self.count
        turns = [self._row(row, cache.begin_turn, layer_idx, slots[row]) for row, cache in enumerate(self.caches)]
        copy_all([pair for turn in turns for pair in turn.carried])  # old tokens read outside the slots: the step's first layer
        tokens = outgoing[:, None, :, None].unbind()  # each row's as its tail holds it: (1, 2, 1, kv_heads, head_dim)
        copy_all([(turn.window, token) for turn, token in zip(turns, tokens)])
        reads = [self._row(row, cache.finish_turn, turn, self.count, waited, self._following[row])
                 for row, (cache, turn) in enumerate(zip(self.caches, turns))]
        reads = [read for read in reads if read is not None]
        if not reads:
            return
        # one job for every row, one batched copy, on the first row's IO thread: its copies (and a
        # disk tier's decoding) run beside this layer's compute, one hand-off a layer
        self._reading = reads[0].store.io.submit(read_all, reads), reads

    def _settle_reads(self) -> float:
        """Finish the read job queued last (run it here if its IO thread has not started it: reading
        beats waiting for its turn); the seconds this thread waited for it."""
        if self._reading is None:
            return 0.0
        (job, reads), self._reading = self._reading, None
        waited_from = time.perf_counter()
        if job.cancel():
            read_all(reads)
        else:
            job.result()
        return time.perf_counter() - waited_from

    @staticmethod
    def _row(row: int, call: Callable[..., T], *args: Any) -> T:
        """`call` for tiered row `row`: its failure is that row's (`TieredRowFailed`)."""
        try:
            return call(*args)
        except Exception as e:  # the engine fails this row, not its batch-mates
            raise TieredRowFailed(row) from e

    def write(self, layer_idx: int, outgoing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's new K/V (`outgoing`) into its slot, one index_put_; the staged K/V of the layer."""
        staged = self.staged[layer_idx % 2]
        staged[:, self._rows, :, self._positions] = outgoing  # indexed: [rows, 2, kv_heads, head_dim]
        return staged[0], staged[1]

    def attend(self, inner: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """One call of the model's attention over the staged rows; their outputs, in row order."""
        return inner(module, query, key, value, self.mask, **kwargs)[0]
