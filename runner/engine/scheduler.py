"""Continuous batching inside one worker: the sequences of every task in flight share each decode step.

One thread owns the model. Each sequence (a single-pass document, a map chunk, a merge pass) is
prefilled on its own, into its own cache, and then joins the decoding batch; every decode step runs
all joined sequences in one forward pass (runner/engine/ragged.py: shared weight matmuls, attention
per sequence, no padding; the sequences whose caches are slots of the worker's KV pool attend as one
group), and a finished sequence leaves at once, freeing its slot for the next.

Admission keeps the batch within `batch.max_sequences` and the worker's budgets: the sum of the
joined sequences' device KV, and of their host KV (tiered rungs), each at its full length (prompt +
new tokens), must fit. A memory error in a step with several sequences splits the batch (every
sequence of it starts again, at most half as many at a time) before any task is told, so only a
sequence that runs out of memory alone moves its task down the cache ladder; a cache that cannot be
made beside the batch for lack of memory (a full KV pool) waits for a smaller batch the same way;
after enough calm decode steps the limit grows back (jobs.batch_limit). Any other error in one
sequence's cache, token choice or finish fails that sequence only, at once; an error the loop cannot
pin on one sequence fails every sequence waiting or decoding with it, and the loop goes on. No
future is left unresolved.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import psutil
import torch

from jobs.batch_limit import GROW_BACK_STEPS, BatchLimit
from jobs.config import LoopStopConfig, PrefillMode, SummarizeConfig
from jobs.outcome import CacheStats
from jobs.stopping import LoopWatch, StopReason
from runner.engine.generation import Generation, TokenPicker, choose_tokens, generate_once, prefill
from runner.engine.kvcache import CacheHandle
from runner.engine.models import LoadedModel
from runner.engine.probes import StageMemory, memory_snapshot
from runner.engine.ragged import RowFailed, decode_step

CacheFactory = Callable[[], CacheHandle]
MemoryErrorTest = Callable[[BaseException], bool]


class TaskClock:
    """When a task's first sequence began to run here (its prefill): where the task's timeout starts,
    so time spent queued behind batch-mates does not count (runner/pool.py asks for it)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def start(self) -> None:
        if self._started is None:
            self._started = time.monotonic()

    def running_s(self) -> float | None:
        """Seconds since the first sequence began; None while every sequence of the task still waits."""
        return None if self._started is None else time.monotonic() - self._started


@dataclass
class PassRequest:
    """One sequence to generate: a prompt, how many tokens, and how to make its cache."""

    prompt_ids: list[int]
    max_new_tokens: int
    make_cache: CacheFactory
    device_bytes: int
    """Device memory its KV takes at full length (prompt + new tokens): what admission sums."""
    host_bytes: int = 0
    """Host RAM its KV takes at full length (a tiered rung's streamed layers): summed the same way."""
    memory: StageMemory = field(default_factory=StageMemory)
    """The task's per-stage memory figures, updated as this sequence runs."""
    clock: TaskClock = field(default_factory=TaskClock)
    """The task's clock, started when its first sequence begins to run."""


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
    loop_stop: LoopStopConfig
    steps: int = 0
    rows_seen: int = 0  # sum over its decode steps of the rows in the step
    watch: LoopWatch = field(init=False)

    def __post_init__(self) -> None:
        self.watch = LoopWatch(self.loop_stop)

    @property
    def request(self) -> PassRequest:
        return self.queued.request

    def stop_reason(self) -> StopReason | None:
        """Why the sequence ends after its latest token; None while it goes on."""
        if self.picker.done:  # generate()'s own stopping criteria
            return self.picker.stop_reason(self.tokens)
        if self.watch.update(self.tokens):
            return StopReason.REPETITION
        return None

    def kept_tokens(self) -> list[int]:
        """Its tokens without the looped tail the loop stop cuts."""
        return self.watch.kept(self.tokens)

    def done(self) -> bool:
        return self.stop_reason() is not None


class BatchScheduler:
    """Runs every sequence submitted to it, batching decode steps; `submit` from any thread."""

    def __init__(self, loaded: LoadedModel, settings: SummarizeConfig, prefill_mode: PrefillMode,
                 max_sequences: int, device_budget: int, is_memory_error: MemoryErrorTest,
                 host_budget: int | None = None, grow_back_steps: int = GROW_BACK_STEPS) -> None:
        """`host_budget`: the worker's host RAM for KV (None: not limited here); `grow_back_steps`:
        calm decode steps before a limit a memory error lowered doubles back (jobs.batch_limit)."""
        self.loaded = loaded
        self.settings = settings
        self.prefill_mode = prefill_mode
        self.limit = BatchLimit(max_sequences, grow_back_steps)
        self.device_budget = device_budget
        self.host_budget = host_budget
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

    @property
    def max_sequences(self) -> int:
        """The most sequences that decode together now: `batch.max_sequences` unless a memory error
        lowered it and it has not grown back yet."""
        return self.limit.current

    @max_sequences.setter
    def max_sequences(self, limit: int) -> None:
        """Set on a memory error only: lowers the limit until calm steps grow it back."""
        self.limit.lower_to(limit)

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
        stopped: BaseException = RuntimeError("the worker stopped")
        try:
            while self._turn():
                pass
        except BaseException as e:  # not even the guard held (e.g. SystemExit): nobody may wait on this thread
            stopped = RuntimeError(f"the worker's scheduler stopped: {type(e).__name__}: {e}")
            raise
        finally:
            with self._changed:
                self._closed = True
            self._fail_waiting(stopped)

    def _turn(self) -> bool:
        """One admission and one decode step; False once closed. An error here that no sequence's own
        handler took is not one sequence's: every waiting future fails with it, and serving goes on."""
        try:
            with self._changed:
                while not self._closed and not self._pending and not self._active:
                    self._changed.wait()
                if self._closed:
                    return False
                joining = self._admissible()
            if joining is not None:
                self._join(joining)
            if self._active:
                self._step()
        except Exception as e:  # noqa: BLE001 - see the docstring
            self._fail_waiting(e)
        return True

    def _fail_waiting(self, error: BaseException) -> None:
        """Fail every sequence waiting or decoding with `error` and drop their caches."""
        with self._changed:
            waiting = [*self._pending, *(s.queued for s in self._active)]
            self._pending.clear()
        active, self._active = self._active, []
        for seq in active:
            _close_quietly(seq.handle)
        for queued in waiting:
            self._fail(queued, error)

    def _admissible(self) -> _Queued | None:
        """The next sequence that may join now (caller holds the lock), taken off the queue.

        Each round of the loop with a batch decoding runs one decode step; a memory error in it
        lowers the limit again, so every round that gets here with a batch counts towards growing
        it back."""
        if self._active:
            self.limit.step()
        if not self._pending:
            return None
        head = self._pending[0].request
        if self._active:
            if len(self._active) >= self.max_sequences:
                return None
            if sum(s.request.device_bytes for s in self._active) + head.device_bytes > self.device_budget:
                return None
            if (self.host_budget is not None
                    and sum(s.request.host_bytes for s in self._active) + head.host_bytes > self.host_budget):
                return None
        return self._pending.popleft()

    def _join(self, queued: _Queued) -> None:
        """Prefill alone, choose the first token, and join the batch (or finish at once)."""
        request = queued.request
        request.clock.start()
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
            picker = TokenPicker(self.loaded, self.settings, request.prompt_ids, request.max_new_tokens)
            first = picker.pick(logits)
        except Exception as e:  # noqa: BLE001 - sorted out just below
            handle.close()
            self._wait_or_fail(queued, e)
            return
        seq = _Sequence(queued, handle, picker, [first], len(request.prompt_ids), started, time.perf_counter(),
                        self.settings.loop_stop)
        try:
            request.memory.prefill_done(memory_snapshot(self.loaded.device))
            if seq.done():
                self._finish(seq)
                return
        except Exception as e:  # noqa: BLE001 - this sequence's alone
            self._fail_sequence(seq, e)
            return
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
        greedy = choose_tokens([s.picker for s in rows], logits)
        for row, seq in enumerate(rows):
            try:
                token = seq.picker.take(greedy[row]) if row in greedy else seq.picker.pick(logits[row : row + 1])
                seq.tokens.append(token)
                seq.position += 1
                seq.steps += 1
                seq.rows_seen += len(rows)
                seq.request.memory.decode_step(rss, device_bytes)
                if seq.done():
                    self._active.remove(seq)
                    self._finish(seq)
            except Exception as e:  # noqa: BLE001 - this sequence's own (e.g. a setting its token choice trips on)
                if seq in self._active:
                    self._active.remove(seq)
                self._fail_sequence(seq, e)

    def _split(self, rows: list[_Sequence]) -> None:
        """Too many sequences for the memory: all of them start again, at most half as many at a time."""
        self.splits += 1
        self.limit.lower_to(len(rows) // 2)
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
        try:
            stats = seq.handle.stats()
        finally:
            seq.handle.close()
        now = time.perf_counter()
        seq.request.memory.decode_done(memory_snapshot(self.loaded.device))
        reason = seq.stop_reason() or StopReason.LENGTH
        generation = Generation(
            tokens=seq.kept_tokens(),
            input_tokens=len(seq.request.prompt_ids),
            ttft_s=seq.first_token_at - seq.started,
            decode_s=now - seq.first_token_at,
            batch_size=seq.rows_seen / seq.steps if seq.steps else 1.0,
            stop_reason=reason,
        )
        seq.queued.future.set_result(PassResult(generation, stats))

    def _fail_sequence(self, seq: _Sequence, error: BaseException) -> None:
        _close_quietly(seq.handle)
        self._fail(seq.queued, error)

    @staticmethod
    def _fail(queued: _Queued, error: BaseException) -> None:
        # without its traceback: the frames would keep the failed cache (and activations) alive
        if not queued.future.done():
            queued.future.set_exception(error.with_traceback(None))


def _close_quietly(handle: CacheHandle) -> None:
    """Close a failed sequence's cache: an error closing it must not hide the error that failed it."""
    with contextlib.suppress(Exception):
        handle.close()
