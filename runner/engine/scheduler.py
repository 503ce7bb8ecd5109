"""Continuous batching inside one worker: the sequences of every task in flight share each decode step.

One thread owns the model. Each sequence (a single-pass document, a map chunk, a merge pass) is
prefilled on its own, into its own cache, and then joins the decoding batch; every decode step runs
all joined sequences in one forward pass (runner/engine/ragged.py: shared weight matmuls, attention
per sequence, no padding; the sequences whose caches are slots of the worker's KV pool attend as one
group), and a finished sequence leaves at once, freeing its slot for the next.

Admission keeps the batch within `batch.max_sequences` and the device budget: the sum of the joined
sequences' device KV (each at its full length, prompt + new tokens) must fit. A memory error in a
step with several sequences splits the batch (every sequence of it starts again, at most half as
many at a time from then on) before any task is told, so only a sequence that runs out of memory
alone moves its task down the cache ladder; a cache that cannot be made beside the batch for lack of
memory (a full KV pool) waits for a smaller batch the same way. Any other error in one sequence's cache fails that
sequence only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import psutil
import torch

from jobs.config import PrefillMode, SummarizeConfig
from jobs.outcome import CacheStats
from runner.engine.generation import Generation, TokenPicker, generate_once, prefill
from runner.engine.kvcache import CacheHandle
from runner.engine.models import LoadedModel
from runner.engine.probes import StageMemory, memory_snapshot
from runner.engine.ragged import RowFailed, decode_step

CacheFactory = Callable[[], CacheHandle]
MemoryErrorTest = Callable[[BaseException], bool]


@dataclass
class PassRequest:
    """One sequence to generate: a prompt, how many tokens, and how to make its cache."""

    prompt_ids: list[int]
    max_new_tokens: int
    make_cache: CacheFactory
    device_bytes: int
    """Device memory its KV takes at full length (prompt + new tokens): what admission sums."""
    memory: StageMemory = field(default_factory=StageMemory)
    """The task's per-stage memory figures, updated as this sequence runs."""


@dataclass(frozen=True)
class PassResult:
    generation: Generation
    cache_stats: CacheStats


@dataclass
class _Queued:
    request: PassRequest
    future: Future[PassResult]
    submitted: float


@dataclass
class _Sequence:
    """A joined sequence: its cache, its tokens so far, its clocks."""

    queued: _Queued
    handle: CacheHandle
    picker: TokenPicker
    tokens: list[int]
    position: int  # of the next token to feed
    started: float
    first_token_at: float
    steps: int = 0
    rows_seen: int = 0  # sum over its decode steps of the rows in the step

    @property
    def request(self) -> PassRequest:
        return self.queued.request

    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens or self.picker.stops(self.tokens[-1])


class BatchScheduler:
    """Runs every sequence submitted to it, batching decode steps; `submit` from any thread."""

    def __init__(self, loaded: LoadedModel, settings: SummarizeConfig, prefill_mode: PrefillMode,
                 max_sequences: int, device_budget: int, is_memory_error: MemoryErrorTest) -> None:
        self.loaded = loaded
        self.settings = settings
        self.prefill_mode = prefill_mode
        self.max_sequences = max_sequences
        self.device_budget = device_budget
        self.is_memory_error = is_memory_error
        self.splits = 0
        """How often a memory error split a batch (each split halves `max_sequences`)."""
        self.most_rows = 0
        """The largest batch a decode step has run: what a test asks to know batching happened."""
        self._pending: deque[_Queued] = deque()
        self._active: list[_Sequence] = []
        self._changed = threading.Condition()
        self._closed = False
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._loop, name="kvbatch-scheduler", daemon=True)
        self._thread.start()

    # -- the task side ---------------------------------------------------------------------------
    def submit(self, request: PassRequest) -> Future[PassResult]:
        future: Future[PassResult] = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("the worker's scheduler is closed")
            self._pending.append(_Queued(request, future, time.perf_counter()))
            self._changed.notify_all()
        return future

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    # -- the model side ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._closed and not self._pending and not self._active:
                    self._changed.wait()
                if self._closed:
                    break
                joining = self._admissible()
            if joining is not None:
                self._join(joining)
            if self._active:
                self._step()
        for queued in [*self._pending, *(s.queued for s in self._active)]:
            queued.future.set_exception(RuntimeError("the worker stopped"))
        for seq in self._active:
            seq.handle.close()

    def _admissible(self) -> _Queued | None:
        """The next sequence that may join now (caller holds the lock), taken off the queue."""
        if not self._pending:
            return None
        head = self._pending[0]
        if self._active:
            if len(self._active) >= self.max_sequences:
                return None
            used = sum(s.request.device_bytes for s in self._active)
            if used + head.request.device_bytes > self.device_budget:
                return None
        return self._pending.popleft()

    def _join(self, queued: _Queued) -> None:
        """Prefill alone, choose the first token, and join the batch (or finish at once)."""
        request = queued.request
        started = time.perf_counter()
        try:
            handle = request.make_cache()
        except Exception as e:  # noqa: BLE001 - the task's error (no room on the offload disk), or a full KV pool
            self._wait_or_fail(queued, e)
            return
        cache = handle.generate_kwargs.get("past_key_values")
        if cache is None:  # transformers' own cache_implementation: generate() runs it, alone
            self._run_whole(queued, handle, started)
            return
        try:
            logits = prefill(self.loaded, request.prompt_ids, self.settings, cache, self.prefill_mode)
            picker = TokenPicker(self.loaded.model, self.settings, request.prompt_ids, request.max_new_tokens)
            first = picker.pick(logits)
        except Exception as e:  # noqa: BLE001 - sorted out just below
            handle.close()
            self._wait_or_fail(queued, e)
            return
        request.memory.prefill_done(memory_snapshot(self.loaded.device))
        seq = _Sequence(queued, handle, picker, [first], len(request.prompt_ids), started, time.perf_counter())
        if seq.done():
            self._finish(seq)
        else:
            self._active.append(seq)

    def _wait_or_fail(self, queued: _Queued, error: BaseException) -> None:
        """A memory error beside the batch waits for a smaller one; any other error is the task's."""
        if self.is_memory_error(error) and self._active:
            self.max_sequences = max(1, len(self._active))
            self._requeue([queued])
        else:
            self._fail(queued, error)

    def _run_whole(self, queued: _Queued, handle: CacheHandle, started: float) -> None:
        request = queued.request
        try:
            generation = generate_once(self.loaded, request.prompt_ids, request.max_new_tokens, self.settings,
                                       handle.generate_kwargs, self.prefill_mode)
            stats = handle.stats()
        except Exception as e:  # noqa: BLE001 - the task's to judge
            self._fail(queued, e)
            return
        finally:
            handle.close()
        request.memory.decode_done(memory_snapshot(self.loaded.device))
        queued.future.set_result(PassResult(generation, stats))

    def _step(self) -> None:
        """One decode step over every joined sequence."""
        rows = list(self._active)
        device = self.loaded.device
        try:
            logits = decode_step(self.loaded.model, [s.tokens[-1] for s in rows], [s.position for s in rows],
                                 [s.handle.generate_kwargs["past_key_values"] for s in rows])  # [rows, vocab]
        except RowFailed as e:
            error = e.__cause__ or e
            if self.is_memory_error(error) and len(rows) > 1:
                self._split(rows)
            else:  # that sequence's own failure; the others' caches took part of this step: they restart
                self._active.remove(rows[e.row])
                self._fail_sequence(rows[e.row], error)
                self._restart([s for s in rows if s is not rows[e.row]])
            return
        except Exception as e:  # noqa: BLE001 - not one sequence's: the batch's (e.g. activations OOM)
            if self.is_memory_error(e) and len(rows) > 1:
                self._split(rows)
            else:
                for seq in rows:
                    self._active.remove(seq)
                    self._fail_sequence(seq, e)
            return
        self.most_rows = max(self.most_rows, len(rows))
        rss = self._process.memory_info().rss
        device_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        for row, seq in enumerate(rows):
            seq.tokens.append(seq.picker.pick(logits[row : row + 1]))
            seq.position += 1
            seq.steps += 1
            seq.rows_seen += len(rows)
            seq.request.memory.decode_step(rss, device_bytes)
            if seq.done():
                self._active.remove(seq)
                self._finish(seq)

    def _split(self, rows: list[_Sequence]) -> None:
        """Too many sequences for the memory: all of them start again, at most half as many at a time."""
        self.splits += 1
        self.max_sequences = max(1, len(rows) // 2)
        self._restart(rows)

    def _restart(self, rows: list[_Sequence]) -> None:
        for seq in rows:
            if seq in self._active:
                self._active.remove(seq)
            seq.handle.close()
        self._requeue([seq.queued for seq in rows])

    def _requeue(self, queued: list[_Queued]) -> None:
        with self._changed:
            self._pending.extendleft(reversed(queued))  # in front, in their order

    def _finish(self, seq: _Sequence) -> None:
        stats = seq.handle.stats()
        seq.handle.close()
        now = time.perf_counter()
        seq.request.memory.decode_done(memory_snapshot(self.loaded.device))
        generation = Generation(
            tokens=seq.tokens,
            input_tokens=len(seq.request.prompt_ids),
            ttft_s=seq.first_token_at - seq.started,
            decode_s=now - seq.first_token_at,
            batch_size=seq.rows_seen / seq.steps if seq.steps else 1.0,
        )
        seq.queued.future.set_result(PassResult(generation, stats))

    def _fail_sequence(self, seq: _Sequence, error: BaseException) -> None:
        seq.handle.close()
        self._fail(seq.queued, error)

    @staticmethod
    def _fail(queued: _Queued, error: BaseException) -> None:
        # without its traceback: the frames would keep the failed cache (and activations) alive
        queued.future.set_exception(error.with_traceback(None))
