"""The pooled decode step with its inputs in static buffers: the form a CUDA graph captures and replays.

Eager, a decode step's ~40 host ops per layer set a GPU's pace (issue 36), so each step is padded to a
batch-size bucket (`BUCKETS`) and one graph per (bucket, runs) is captured and replayed. How the pool
rows, passengers, padding rows, runs, bans and the step ahead work: docs/kv-cache.md, "The pooled decode
step" ("The static step", "A step ahead of the read"). Nothing in the step reads the device back, so the
host can launch the next step before reading this one (tests/test_static_step.py runs it on the meta
device). A graph belongs to the pool's `generation` (an address can come back with another shape); a
capture that fails is logged once and that (bucket, runs) runs eagerly, with the same tokens.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import torch
from transformers import PreTrainedModel

from runner.engine.batched_logits import ANY, Ban
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.pooled_attention import SPAN_GRANULE, PooledStep, aligned, attention_runs, length_mask
from runner.engine.ragged import SequenceBatch, ragged_step
from runner.engine.step_inputs import step_inputs
from runner.engine.word_pieces import WordPieces

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))
"""Rows a step is padded to (nano-vllm's): each is one graph per span."""
GRAPH_SPAN_TOKENS = 4 * SPAN_GRANULE
"""The shortest span a captured step reads."""
GRAPH_SPANS = tuple(GRAPH_SPAN_TOKENS * m for k in range(12) for m in (2**k, 3 * 2 ** (k - 1)) if m == int(m))
"""The spans a captured step reads, ×1.5 or ×1.33 apart (256, 512, 768, 1024, 1536, ...): a graph per
span of these, not per 256 tokens, so a 32k pool has 14 spans per bucket, not 128."""


STEP_RUNS = 16
"""Attention calls a layer at most (runs of slots in slot order, each read up to its own longest row;
each call after the first charged `RUN_TOKENS`, so a cut is made where it saves more reads than a call
costs). More than the eager step's `MOST_RUNS`: slots are in the order their sequences joined, in which
long and short rows can alternate, and a captured step launches its calls without the host. On 16 rows
of 50 to 7,500 tokens alternating long and short, 16 read 1.03x the rows' own tokens, 8 1.5x, 4 2.3x,
one call 3.2x (tests/test_static_step_runs.py)."""
MOST_GRAPHS = 128
"""Graphs kept per pool generation (the least recently replayed goes first): every bucket's one-run
step over every span captured at start, and the multi-run ones a batch of mixed lengths meets."""
Runs = tuple[tuple[int, int, int], ...]
"""A step's attention calls a layer: (first slot, end slot, span), in slot order."""

BAN_WIDTH = 8
"""Banned tokens a ban entry holds at most (the summary's 4-gram ban rarely bans more than 2)."""
BAN_CHOICES = 4
"""Ban entries a row takes into the step at most: one for a row whose input the host knows (two with
a minimum length), one per next token that brings a ban for a row whose input comes from the device. A
row with more chooses its token on the host."""
NEVER = -2
"""A padding entry's `after`: no input token matches it."""


class Eager(StrEnum):
    """Why a decode row-step ran in the eager step, off the static one (counted per sequence: job.log,
    the result row's `static_step_share`, `kvbatch status`)."""

    OFF = "static_step off"  # `batch.static_step` is off (or the worker's attention is per-row)
    NOT_POOL = "not pool"  # the row's KV is no slot of the pool (a tiered rung, a per-row cache)
    OVER_SLOTS = "bucket over pool slots"  # the live slots' bucket has more rows than the pool has slots


def bucket(rows: int) -> int:
    """The smallest bucket that holds `rows`."""
    return next(size for size in BUCKETS if size >= rows)


@functools.lru_cache(maxsize=4096)
def _runs(spans: tuple[int, ...], most: int) -> Runs:
    return tuple(attention_runs(spans, most))


def graph_span(tokens: int, room: int) -> int:
    """The span a captured step reads for rows of up to `tokens`: the first of `GRAPH_SPANS` that holds
    them, within the pool's `room` (every slot's tokens), or the room itself."""
    at = bisect.bisect_left(GRAPH_SPANS, tokens)
    return min(GRAPH_SPANS[at] if at < len(GRAPH_SPANS) else room, room)


class _StaticRows(PooledStep):
    """The pooled rows of one static step (`SequenceBatch`'s `pooled`): a bucket's buffers, read in
    `runs`, the mask made on the device from the buffers' lengths."""

    def __init__(self, pool: KVPool, buffers: _Buffers, runs: Runs) -> None:  # not super().__init__: that one reads host lists
        span = max(span for _, _, span in runs)
        self.pool, self.caches, self.count, self.live, self.span = pool, [], buffers.rows, buffers.rows, span
        self.packed = True
        self.slots, self.positions = buffers.slots, buffers.positions
        self.mask = length_mask(buffers.lengths, span, pool.dtype, pool.device, "pooled lengths")
        self.runs = list(runs)


class _Buffers:
    """A bucket's static inputs and outputs on the device."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.slots = torch.arange(rows, device=device)  # row i is slot i: the step's rows are the live slots
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)  # attended tokens, the new one included
        self.after = torch.full((rows, BAN_CHOICES), NEVER, dtype=torch.long, device=device)
        self.banned = torch.zeros((rows, BAN_CHOICES, BAN_WIDTH), dtype=torch.long, device=device)  # vocab: none
        self.glued = torch.zeros((rows, BAN_CHOICES), dtype=torch.bool, device=device)
        self.logits: torch.Tensor | None = None  # [rows, vocab] float32, made by the first run
        self.tokens: torch.Tensor | None = None  # [rows] each row's greedy token, its bans applied


class StaticStep:
    """The worker's static decode steps over `pool`; `graphs`: capture and replay them (CUDA only)."""

    def __init__(self, model: PreTrainedModel, pool: KVPool, graphs: bool, pieces: WordPieces | None = None,
                 most_runs: int = STEP_RUNS) -> None:
        """`pieces`: the tokenizer's word pieces the summary's n-gram ban reads (runner/engine/word_pieces.py);
        `most_runs`: attention calls a layer at most (1: every slot up to the longest row)."""
        self.model, self.pool, self.pieces, self.most_runs = model, pool, pieces, most_runs
        self.graphs = graphs
        head = model.get_output_embeddings()
        self.vocab: int = getattr(head, "out_features", None) or model.config.get_text_config(decoder=True).vocab_size
        """The logits' width: a banned id at or past it is none."""
        self._continues = (pieces.mask("continues", torch.empty((0, self.vocab), device=pool.device))
                           if pieces is not None else None)
        self._buffers: dict[int, _Buffers] = {}
        self._captured: OrderedDict[tuple[int, Runs], torch.cuda.CUDAGraph] = OrderedDict()
        self._eager: set[tuple[int, Runs]] = set()
        """(bucket, runs) whose capture failed: they run eagerly."""
        self._generation: int | None = None  # the pool buffers the graphs (and failures) are of
        self._graph_pool: Any = None
        self.steps = 0
        """Steps run here: what a test asks to know this path ran."""
        self.buckets_run: set[int] = set()
        self.passenger_steps = 0
        """Steps run with a live slot that was no row of theirs (a riding prompt's)."""
        self.banned_steps = 0
        """Steps whose rows' bans were applied in the step (their tokens the default config's choice)."""
        self.glued_row_steps = 0
        """Row-steps that could ban word-continuing tokens too: what a test asks to know that part ran."""
        self.row_steps = 0
        """Rows over the steps run here (a row that ended at the step before, not read yet, included)."""
        self.ahead_row_steps = 0
        """Row-steps whose input token came from the device, the step before not read yet."""

        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0
        self.capture_failure: str | None = None
        """Why the first failed capture failed (logged once); `failed_captures` counts them all."""
        self.failed_captures = 0
        self.fail_captures: str | None = None
        """Set: every capture raises this, before any CUDA call (KVBATCH_FAULTS' `capture` rule)."""

    def why_eager(self, cache: Any) -> Eager | None:
        """Why a decode row of this cache cannot run in this step; None when it can: its KV is a slot of
        the pool, and the pool has a free slot for each padding row of its live slots' bucket."""
        if getattr(cache, "pool", None) is not self.pool:
            return Eager.NOT_POOL
        if bucket(len(self.pool.owners)) > self.pool.slots:
            return Eager.OVER_SLOTS
        return None

    def ban_fits(self, ban: Ban | None) -> bool:
        """Whether a row's bans (`TokenPicker.ban`; None: its choice is the host's) go into the step."""
        return ban is not None and len(ban) <= BAN_CHOICES and all(
            len(banned) <= BAN_WIDTH and (not glued or self._continues is not None) for _, banned, glued in ban)

    def run(self, last_tokens: Sequence[int], caches: Sequence[PooledCache], bans: Sequence[Ban] | None = None,
            ahead: tuple[torch.Tensor, Sequence[int | None]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of `caches` (their last tokens in the same order; each `why_eager` None): each row's
        logits ([rows, vocab] float32) and greedy token ([rows]) over its `bans` (each `ban_fits`; None: no
        bans), on the device, in the order of `caches`. `ahead`: a device tensor of tokens and, for each
        row, where its input token is in it (None: `last_tokens`'). A live slot among theirs that is no
        row rides as a passenger. Nothing here waits on the device."""
        owners = self.pool.owners
        rows = {cache.slot: row for row, cache in enumerate(caches)}
        size = bucket(max(rows) + 1)  # up to the last row's slot: a riding prompt's slot after it sits out
        lengths = [cache.length for cache in caches]
        span = aligned(max(lengths) + 1)
        carried = owners[:size]  # the bucket's live slots: the rows, and any passenger among them
        # a passenger writes at its own length: room for that too
        self.pool.ensure(len(owners), max(span, *(owner.length + 1 for owner in carried)))
        buffers = self._buffers_of(size)
        ids, positions, attended = [0] * size, [0] * size, [1] * size  # padding: position 0, one key
        after, banned, glued = [NEVER] * (size * BAN_CHOICES), [self.vocab] * (size * BAN_CHOICES * BAN_WIDTH), \
            [0] * (size * BAN_CHOICES)
        from_device: list[tuple[int, int]] = []  # (slot, where its input token is in `ahead`'s tensor)
        for slot, owner in enumerate(carried):
            row = rows.get(slot)
            positions[slot] = owner.length
            if row is None:
                continue
            attended[slot] = owner.length + 1
            at = ahead[1][row] if ahead is not None else None
            if at is None:
                ids[slot] = last_tokens[row]
            else:
                from_device.append((slot, at))
            entries = bans[row] if bans is not None else ()
            for choice, (token, tokens, glues) in enumerate(entries):
                entry = slot * BAN_CHOICES + choice
                after[entry], glued[entry] = token, int(glues)
                banned[entry * BAN_WIDTH : entry * BAN_WIDTH + len(tokens)] = tokens
            self.glued_row_steps += any(glues for _, _, glues in entries)
        runs = self._runs(attended)
        inputs = step_inputs(self.pool.device)
        for buffer, kind, values in ((buffers.ids, "ids", ids), (buffers.positions, "positions", positions),
                                     (buffers.lengths, "pooled lengths", attended), (buffers.after, "ban after", after),
                                     (buffers.banned, "banned", banned), (buffers.glued, "glued", glued)):
            buffer.view(-1).copy_(inputs.put(kind, values), non_blocking=True)
        if from_device:
            assert ahead is not None
            slots, at = zip(*from_device, strict=True)
            buffers.ids.index_copy_(0, inputs.put("ids from the device", slots),
                                    ahead[0].index_select(0, inputs.put("ids ahead", at)))
        if self.graphs:
            self._replay(buffers, runs)
        else:
            self._forward(buffers, runs)
        for cache in caches:
            cache.length += 1
        self.steps += 1
        self.banned_steps += bans is not None
        self.ahead_row_steps += len(from_device)
        self.row_steps += len(caches)
        self.passenger_steps += len(caches) < len(carried)
        self.buckets_run.add(size)
        self.pool.steps += 1
        self.pool.most_rows = max(self.pool.most_rows, len(caches))
        assert buffers.logits is not None and buffers.tokens is not None
        slots = [cache.slot for cache in caches]
        if slots == list(range(len(caches))):  # the rows are the live slots, in slot order: no gather
            return buffers.logits[: len(caches)], buffers.tokens[: len(caches)]
        at = inputs.put("order", slots)
        return buffers.logits[at], buffers.tokens[at]

    def _span(self, tokens: int) -> int:
        """What a call reads for rows of up to `tokens` (aligned): captured, one of a few spans."""
        return max(aligned(tokens), graph_span(aligned(tokens), self.pool.tokens)) if self.graphs else aligned(tokens)

    def _runs(self, attended: list[int]) -> Runs:
        """The bucket's slots (slot i attends its first `attended[i]` keys) in runs of like lengths, cut
        over the spans each would read: those change every 64 tokens (captured: every ×1.5), so a
        batch's steps mostly find their cut made already."""
        return _runs(tuple(self._span(tokens) for tokens in attended), self.most_runs)

    def _forward(self, buffers: _Buffers, runs: Runs) -> None:
        """The step itself, from the buffers to the outputs: what a graph captures."""
        rows = _StaticRows(self.pool, buffers, runs)
        with torch.inference_mode(), ragged_step(self.model):
            out = self.model(input_ids=buffers.ids[None], position_ids=buffers.positions[None],
                             past_key_values=SequenceBatch([], pooled=rows), use_cache=True, logits_to_keep=0)
        logits = out.logits[0].float()  # [rows, vocab]
        if buffers.logits is None or buffers.logits.shape != logits.shape:
            buffers.logits = torch.empty_like(logits)
            buffers.tokens = torch.empty(buffers.rows, dtype=torch.long, device=logits.device)
        buffers.logits.copy_(logits)
        # the bans as a mask: the entries the input token matches, scattered into one column more
        # (where the padding's and the unmatched entries' id, the vocabulary's width, lands: dropped)
        matched = (buffers.after == buffers.ids[:, None]) | (buffers.after == ANY)  # [rows, choices]
        ids = torch.where(matched[:, :, None], buffers.banned, self.vocab).flatten(1)
        banned = torch.zeros((buffers.rows, self.vocab + 1), dtype=torch.bool, device=logits.device)
        banned = banned.scatter_(1, ids, True)[:, : self.vocab]
        if self._continues is not None:
            banned |= (matched & buffers.glued).any(dim=-1, keepdim=True) & self._continues
        torch.argmax(logits.masked_fill(banned, -float("inf")), dim=-1, out=buffers.tokens)

    def capture_all(self, rows: int) -> None:
        """Capture every bucket up to `rows`' (within the pool's slots) over every graph span of the
        pool, largest first (the smaller ones reuse the largest's graph memory): at worker start, so no
        capture stalls a batch. Nothing without graphs or a pool."""
        if not self.graphs or self.pool.keys is None:
            return
        sizes = [size for size in BUCKETS if size <= min(bucket(rows), self.pool.slots)]
        spans = sorted({graph_span(span, self.pool.tokens) for span in GRAPH_SPANS if span < self.pool.tokens}
                       | {self.pool.tokens})
        self._keep_generation()
        for size in reversed(sizes):
            buffers = self._buffers_of(size)
            for span in reversed(spans):
                self._graph(buffers, ((0, size, span),))

    def _buffers_of(self, size: int) -> _Buffers:
        buffers = self._buffers.get(size)
        if buffers is None:
            buffers = self._buffers[size] = _Buffers(size, self.pool.device)
        return buffers

    def _keep_generation(self) -> None:
        """Drop the graphs (and failures) of another generation of the pool: they wrote its old buffers."""
        if self._generation != self.pool.generation:
            self._captured.clear()
            self._eager.clear()
            self._generation = self.pool.generation

    def _replay(self, buffers: _Buffers, runs: Runs) -> None:
        """The captured step of this bucket and runs (captured now if it is new), or the eager step
        where its capture failed."""
        self._keep_generation()
        graph = self._graph(buffers, runs)
        if graph is None:
            self._forward(buffers, runs)
        else:
            self._captured.move_to_end((buffers.rows, runs))
            graph.replay()
            self.replays += 1

    def _graph(self, buffers: _Buffers, runs: Runs) -> torch.cuda.CUDAGraph | None:
        """The graph of (bucket, runs), captured now if it is new; None, its key marked eager, when its
        capture fails (the first failure logged with its reason: the step is the same without the graph)."""
        key = (buffers.rows, runs)
        if key in self._captured or key in self._eager:
            return self._captured.get(key)
        try:
            return self._capture(buffers, runs)
        except Exception as e:  # noqa: BLE001 - whatever it was, the eager step gives the same tokens
            self._eager.add(key)
            self.failed_captures += 1
            if self.capture_failure is None:
                self.capture_failure = f"{type(e).__name__}: {e}"
                log.warning("capturing the decode step for %d rows in runs %s failed (%s): such steps "
                            "run eagerly, with the same tokens", buffers.rows, runs, self.capture_failure)
            return None

    def _capture(self, buffers: _Buffers, runs: Runs) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream (allocator and kernels' first-run work), then capture it.
        The warm-up and the capture write the padding rows' KV at their positions: slots nobody reads
        at positions the real rows' writes repeat with the same values."""
        if self.fail_captures is not None:
            raise RuntimeError(self.fail_captures)
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.pool.device)
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            self._forward(buffers, runs)
        torch.cuda.current_stream(self.pool.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._forward(buffers, runs)
        if len(self._captured) >= MOST_GRAPHS:
            self._captured.popitem(last=False)  # the least recently replayed
        self._captured[buffers.rows, runs] = graph
        self.captures += 1
        self.capture_s += time.perf_counter() - started
        log.debug("captured the decode step for %d rows in runs %s", buffers.rows, runs)
        return graph
