"""Continuous batching inside one worker: the sequences of every task in flight share each decode step.

One thread owns the model and runs turns of schedule -> run -> postprocess: `BatchPlan` (no model in it)
decides, this module runs the prefills and steps and hands the outcome back. Prefill chunks riding the
decode rows, the static step beside the eager rows, admission, the OOM split and growing back:
docs/kv-cache.md, "Batched decode steps". A memory error with several sequences splits the batch before
any task is told; an error the loop cannot pin on one sequence fails every sequence with it, and the
loop goes on. No future is left unresolved.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import psutil
import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from jobs.config import PREFILL_CHUNK_TOKENS, PrefillMode, SummarizeConfig
from jobs.outcome import CacheStats, DecodeSteps, no_steps
from jobs.stopping import StopReason
from runner.engine.batch_plan import BatchPlan, BatchSequence, Status
from runner.engine.batched_logits import Ban
from runner.engine.generation import Generation, TokenPicker, choose_tokens, generate_once, prefill
from runner.engine.kvcache import CacheHandle
from runner.engine.model_loader import LoadedModel
from runner.engine.probes import StageMemory, memory_snapshot
from runner.engine.ragged import MASKED_ATTENTION, PrefillChunk, RowFailed, mixed_step
from runner.engine.static_step import Eager, StaticStep
from runner.engine.step_inputs import step_inputs

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
    fits: Callable[[], bool] | None = None
    """Whether the worker's KV pool has room for it now (a pooled sequence's; None: not the pool's)."""
    memory: StageMemory = field(default_factory=StageMemory)
    """The task's per-stage memory figures, updated as this sequence runs."""
    clock: TaskClock = field(default_factory=TaskClock)
    """The task's clock, started when its first sequence begins to run."""


@dataclass(frozen=True)
class PassResult:
    generation: Generation
    cache_stats: CacheStats
    decode_steps: DecodeSteps = field(default_factory=no_steps)
    """Its decode steps by path (static, or eager and why); none for a pass generate() ran whole."""


class BatchEngine:
    """Runs every sequence submitted to it, batching decode steps; `submit` from any thread."""

    def __init__(self, loaded: LoadedModel, settings: SummarizeConfig, prefill_mode: PrefillMode,
                 max_sequences: int, device_budget: int, is_memory_error: MemoryErrorTest,
                 host_budget: int | None = None, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                 static: StaticStep | None = None) -> None:
        """`host_budget`: the worker's host RAM for KV (None: not limited here);
        `prefill_chunk_tokens`: a joining prompt's tokens a step beside the decode rows (0: whole);
        `static`: runs the steps whose rows are all its KV pool's (`batch.static_step`)."""
        self.loaded = loaded
        self.settings = settings
        self.prefill_mode = prefill_mode
        self.prefill_chunk_tokens = prefill_chunk_tokens if _chunks_fit(loaded) else 0
        # a prompt prefilled whole goes in the chunks a riding one would (generate()'s chunked prefill is
        # then the riding chunks' computation): its tokens do not depend on whether others were decoding
        self.prefill_settings = (settings.model_copy(update={"prefill_chunk_size": self.prefill_chunk_tokens})
                                 if self.prefill_chunk_tokens else settings)
        self.plan = BatchPlan(max_sequences, device_budget, host_budget)
        self.is_memory_error = is_memory_error
        self.static = static
        self._ahead: Ahead | None = None
        """The step launched and not read yet (`_decode`)."""
        self._changed = threading.Condition()  # guards the plan: `submit` adds to it from other threads
        self._closed = False
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._loop, name="kvbatch-engine", daemon=True)
        self._thread.start()

    # -- the task side ---------------------------------------------------------------------------
    def submit(self, request: PassRequest) -> Future[PassResult]:
        """Queue one sequence; its future holds its result."""
        future: Future[PassResult] = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("the worker's engine is closed")
            self.plan.add(BatchSequence(request, future, self.settings.loop_stop))
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
            stopped = RuntimeError(f"the worker's engine stopped: {type(e).__name__}: {e}")
            raise
        finally:
            with self._changed:
                self._closed = True
            self._fail_waiting(stopped)

    def _turn(self) -> bool:
        """One turn: schedule, run the prefill and the decode step, postprocess; False once closed. An
        error here that no sequence's own handler took is not one sequence's: every waiting future
        fails with it, and serving goes on."""
        try:
            with self._changed:
                while not self._closed and not self.plan.waiting and not self.plan.running:
                    self._changed.wait()
                if self._closed:
                    return False
                prefill = self.plan.schedule()
            if prefill is not None and prefill.handle is None:
                self._start(prefill)
            rows, riding = self.plan.decoding, self.plan.prefilling
            if rows or riding is not None:
                self._decode(rows, riding)
        except Exception as e:  # noqa: BLE001 - see the docstring
            self._fail_waiting(e)
        return True

    def _fail_waiting(self, error: BaseException) -> None:
        """Fail every sequence waiting or running with `error` and drop their caches."""
        self._ahead = None  # its rows are among those failed here
        with self._changed:
            everyone = self.plan.drain()
        for seq in everyone:
            if seq.handle is not None:
                _close_quietly(seq.handle)
        for seq in everyone:
            self._fail(seq, error)

    def _start(self, seq: BatchSequence) -> None:
        """Make its cache and token picker; then its prompt rides the next steps chunk by chunk, or is
        prefilled alone now and the sequence joins the batch (or finishes at once)."""
        request = seq.request
        request.clock.start()
        try:
            seq.handle = request.make_cache()
        except Exception as e:  # noqa: BLE001 - the task's error (no room on the offload disk), or a full KV pool
            self._wait_or_fail(seq, e)
            return
        cache = seq.handle.cache
        if cache is None:  # transformers' own cache_implementation: generate() builds and runs it, alone
            self._run_whole(seq)
            return
        try:
            seq.picker = TokenPicker(self.loaded, self.settings, request.prompt_ids, request.max_new_tokens)
            if self._rides(cache):
                seq.chunk_tokens = self.prefill_chunk_tokens
                return
            logits = prefill(self.loaded, request.prompt_ids, self.prefill_settings, cache, self.prefill_mode)
        except Exception as e:  # noqa: BLE001 - sorted out just below
            seq.handle.close()
            self._wait_or_fail(seq, e)
            return
        seq.prefilled = len(request.prompt_ids)
        self._first_token(seq, logits)

    def _rides(self, cache: Cache) -> bool:
        """Whether a prompt goes in chunks beside the decode rows: there are some, and its cache takes a
        chunk as one more row (which caches do: docs/kv-cache.md, "Batched decode steps")."""
        return (self.prefill_chunk_tokens > 0 and bool(self.plan.decoding) and self.prefill_mode != "layer-major"
                and getattr(cache, "takes_chunks", False))

    def _first_token(self, seq: BatchSequence, logits: torch.Tensor) -> None:
        """Its prompt is in its cache: the first token from the last position's logits ([1, vocab]),
        then it joins the batch, or finishes at once."""
        try:
            seq.take(seq.picker.pick(logits))
            seq.request.memory.prefill_done(memory_snapshot(self.loaded.device))
            if seq.stop_reason() is not None:
                self._finish(seq)
                return
        except Exception as e:  # noqa: BLE001 - this sequence's alone
            self._fail_sequence(seq, e)
            return
        with self._changed:
            self.plan.joined(seq)

    def _wait_or_fail(self, seq: BatchSequence, error: BaseException) -> None:
        """A memory error beside the batch waits for a smaller one; any other error is the task's."""
        with self._changed:
            waits = self.is_memory_error(error) and self.plan.wait_for_room(seq)
        if not waits:
            self._leave(seq, Status.FAILED)
            self._fail(seq, error)

    def _run_whole(self, seq: BatchSequence) -> None:
        request = seq.request
        try:
            generation = generate_once(self.loaded, request.prompt_ids, request.max_new_tokens, self.settings,
                                       seq.handle.generate_kwargs, self.prefill_mode)
            stats = seq.handle.stats()
        except Exception as e:  # noqa: BLE001 - the task's to judge
            self._leave(seq, Status.FAILED)
            self._fail(seq, e)
            return
        finally:
            seq.handle.close()
        self._leave(seq, Status.FINISHED)
        request.memory.observe(memory_snapshot(self.loaded.device))
        seq.future.set_result(PassResult(generation, stats))

    def _decode(self, rows: list[BatchSequence], riding: BatchSequence | None) -> None:
        """One decode step over `rows` (every decoding sequence) with the next chunk of `riding`'s prompt
        beside them; then each row's token, and `riding`'s first once its prompt is in.

        A step the static step chose every token of is read only after the next is launched (`_ahead`),
        so the host never waits on the step it just launched (docs/kv-cache.md, "The pooled decode
        step", "A step ahead of the read"); a row that ended there drops the step it took beyond."""
        ahead, self._ahead = self._ahead, None
        plan = None
        if ahead is not None:
            run = [seq for seq in rows if not ahead.ends(seq)]  # a row whose last token is ahead is done with it
            plan = self._ahead_plan(run, ahead) if run else None
            if plan is None:
                self._choose(ahead.rows, None, ahead.chosen)
                rows = self.plan.decoding
                if not rows and riding is None:
                    return
            else:
                rows = run
        chunk = None
        if riding is not None:
            start, end = self.plan.next_chunk(riding)
            prompt = riding.request.prompt_ids
            chunk = PrefillChunk(riding.handle.cache, prompt[start:end], start,
                                 wants_logits=end == len(prompt))
        everyone = rows + ([riding] if riding is not None else [])  # RowFailed numbers the chunk's row last
        caches = [s.handle.cache for s in rows]
        eager_because = [Eager.OFF if self.static is None else self.static.why_eager(c) for c in caches]
        try:
            logits, chosen, first_logits = self._step(
                rows, caches, eager_because, chunk, (ahead.chosen.tokens, plan) if plan is not None else None)
        except Exception as e:  # noqa: BLE001 - sorted out in `_failed`
            if plan is not None:  # the step before is read first: its tokens stand
                self._choose(ahead.rows, None, ahead.chosen)
            self._failed(everyone, e)
            return
        if plan is not None:
            self._choose(ahead.rows, None, ahead.chosen)  # the step before, while the device runs this one
        going_on = [row for row, seq in enumerate(rows) if seq.status is Status.DECODING]  # an ended row's step is dropped
        if going_on:
            with self._changed:
                self.plan.decoded([rows[row] for row in going_on], beside_prefill=chunk is not None,
                                  eager_because=[eager_because[row] for row in going_on],
                                  ahead=[plan[rows[row]][0] is not None for row in going_on] if plan is not None else ())
        if riding is not None and chunk is not None:
            riding.prefilled += len(chunk.tokens)
            if first_logits is not None:
                self._first_token(riding, first_logits)
        if chosen is not None and len(chosen.rows) == len(rows) and all(chosen.fit):
            self._ahead = Ahead(rows, chosen)  # read after the next step is launched
        else:
            self._choose(rows, logits, chosen)

    def _ahead_plan(self, rows: list[BatchSequence], ahead: Ahead
                    ) -> dict[BatchSequence, tuple[int | None, Ban]] | None:
        """Each row's input and bans when the next step can be launched before the step ahead is read:
        every row on the static step with bans that fit it, the step ahead's rows by where their token
        is in its tokens (their bans by what that token could be), the others (just joined) by their
        host token (None). None otherwise."""
        if self.static is None:
            return None
        at = {seq: i for i, seq in enumerate(ahead.rows)}
        plan = {}
        for seq in rows:
            if self.static.why_eager(seq.handle.cache) is not None:
                return None
            ban = seq.picker.ban(self.static.vocab, self.static.pieces, ahead=seq in at)
            if ban is None or not self.static.ban_fits(ban):
                return None
            plan[seq] = (at.get(seq), ban)
        return plan

    def _failed(self, everyone: list[BatchSequence], error: BaseException) -> None:
        """A step raised: a memory error splits the batch; a row's own error fails it and restarts the
        others (their caches took part of the step); any other error fails them all. Rows that ended
        meanwhile (the step ahead read) are left as they are."""
        failing = everyone[error.row] if isinstance(error, RowFailed) else None
        if isinstance(error, RowFailed):
            error = error.__cause__ or error
        everyone = [seq for seq in everyone if seq.status in (Status.DECODING, Status.PREFILLING)]
        if self.is_memory_error(error) and len(everyone) > 1:
            self._restart(everyone, split=True)
        elif failing is not None:
            if failing in everyone:
                self._fail_sequence(failing, error)
            self._restart([seq for seq in everyone if seq is not failing])
        else:
            for seq in everyone:
                self._fail_sequence(seq, error)

    def _step(self, rows: list[BatchSequence], caches: list[Cache], eager_because: list[Eager | None],
              chunk: PrefillChunk | None, ahead: tuple[torch.Tensor, dict[BatchSequence, tuple[int | None, Ban]]] | None = None
              ) -> tuple[torch.Tensor, Chosen | None, torch.Tensor | None]:
        """The forward passes of one step: the static step over the rows it takes (`eager_because` None),
        one eager `mixed_step` over the others with `chunk` beside them. Returns each row's logits
        ([rows, vocab]), the tokens the static step chose on the device, and the chunk's last logits
        when it wants them ([1, vocab]). `ahead`: the step ahead's device tokens and every row's input
        and bans (`_ahead_plan`). A `RowFailed` numbers the rows as `rows`, the chunk's last."""
        static = [row for row, why in enumerate(eager_because) if why is None]
        eager = [row for row, why in enumerate(eager_because) if why is not None]
        parts, chosen, first_logits = [], None, None
        if static:
            assert self.static is not None
            if ahead is not None:  # the plan made them: every row on the static step, its bans fit
                at, bans = zip(*(ahead[1][rows[row]] for row in static), strict=True)
            else:
                at = (None,) * len(static)
                bans = tuple(rows[row].picker.ban(self.static.vocab, self.static.pieces) for row in static)
            fits = [self.static.ban_fits(ban) for ban in bans]
            device_tokens = (ahead[0], at) if ahead is not None and any(where is not None for where in at) else None
            static_logits, tokens = self.static.run([rows[row].tokens[-1] for row in static],
                                                    [caches[row] for row in static],
                                                    [ban if fit else [] for ban, fit in zip(bans, fits)]
                                                    if any(fits) else None, device_tokens)
            chosen = Chosen(static, tokens, fits) if any(fits) else None
            parts.append(static_logits)
        if eager or chunk is not None:
            try:
                eager_logits, first_logits = mixed_step(
                    self.loaded.model, [rows[row].tokens[-1] for row in eager], [rows[row].position for row in eager],
                    [caches[row] for row in eager], chunk)  # [eager rows, vocab], [1, vocab]
            except RowFailed as e:
                raise RowFailed(eager[e.row] if e.row < len(eager) else len(rows)) from e.__cause__
            parts.append(eager_logits)
        if not eager or not static:
            return parts[0], chosen, first_logits
        back = step_inputs(parts[0].device).put("rows order", static + eager).argsort()  # row i's place in the parts
        return torch.cat(parts)[back], chosen, first_logits

    def _choose(self, rows: list[BatchSequence], logits: torch.Tensor | None, chosen: Chosen | None = None) -> None:
        """Each row's next token: the static step's choice where it made one, else from the step's
        logits ([rows, vocab]) on the host; a row that ends leaves. A row no longer decoding (it ended
        with the step before: this one ran ahead of that being read) drops its token."""
        device = self.loaded.device
        rss = self._process.memory_info().rss
        device_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        pickers = [s.picker for s in rows]
        greedy = chosen.read() if chosen is not None else {}  # the step's one read of the device
        rest = [row for row in range(len(rows)) if row not in greedy]
        if rest:
            assert logits is not None, "a step read ahead had every token chosen on the device"
            picked = choose_tokens([pickers[row] for row in rest], logits if len(rest) == len(rows) else logits[rest])
            greedy.update({rest[i]: token for i, token in picked.items()})
        for row, seq in enumerate(rows):
            if seq.status is not Status.DECODING:
                continue
            try:
                seq.take(seq.picker.take(greedy[row]) if row in greedy else seq.picker.pick(logits[row : row + 1]))
                seq.request.memory.decode_step(rss, device_bytes)
                if seq.stop_reason() is not None:
                    self._finish(seq)
            except Exception as e:  # noqa: BLE001 - this sequence's own (e.g. a setting its token choice trips on)
                self._fail_sequence(seq, e)

    def _restart(self, rows: list[BatchSequence], split: bool = False) -> None:
        """`rows` start again; `split`: too many sequences for the memory, at most half as many at a time."""
        for seq in rows:
            seq.handle.close()
        with self._changed:
            (self.plan.split if split else self.plan.requeue)(rows)

    def _leave(self, seq: BatchSequence, status: Status) -> None:
        with self._changed:
            self.plan.leave(seq, status)

    def _finish(self, seq: BatchSequence) -> None:
        self._leave(seq, Status.FINISHED)
        try:
            stats = seq.handle.stats()
        finally:
            seq.handle.close()
        now = time.perf_counter()
        seq.request.memory.observe(memory_snapshot(self.loaded.device))
        generation = Generation(
            tokens=seq.kept_tokens(),
            input_tokens=len(seq.request.prompt_ids),
            ttft_s=seq.first_token_at - seq.started,
            decode_s=now - seq.first_token_at,
            batch_size=seq.batch_size,
            stop_reason=seq.stop_reason() or StopReason.LENGTH,
        )
        seq.future.set_result(PassResult(generation, stats, seq.decode_steps))

    def _fail_sequence(self, seq: BatchSequence, error: BaseException) -> None:
        self._leave(seq, Status.FAILED)
        _close_quietly(seq.handle)
        self._fail(seq, error)

    @staticmethod
    def _fail(seq: BatchSequence, error: BaseException) -> None:
        # without its traceback: the frames would keep the failed cache (and activations) alive
        if not seq.future.done():
            seq.future.set_exception(error.with_traceback(None))


class Chosen:
    """The static step's tokens ([its rows], on the device) for `rows` (the step's rows it ran), of
    which those that `fit` were chosen as their pickers choose (`TokenPicker.ban`). On CUDA they are
    copied to pinned host memory as soon as the step is queued, and an event marks the copy: reading
    them waits for that step alone, not for a step queued after it (`BatchEngine._decode`)."""

    def __init__(self, rows: list[int], tokens: torch.Tensor, fit: list[bool]) -> None:
        self.rows, self.tokens, self.fit = rows, tokens, fit
        self._copied: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(tokens.device))
        else:  # the step's output buffers are the next step's: keep this one's values
            self._host = tokens.clone()

    def read(self) -> dict[int, int]:
        """The chosen tokens by the step's row, read from the device."""
        if self._copied is not None:
            self._copied.synchronize()
        return {row: token for row, token, fit in zip(self.rows, self._host.tolist(), self.fit) if fit}


@dataclass(frozen=True)
class Ahead:
    """A step launched and not read yet: its rows and the tokens the static step chose for them all."""

    rows: list[BatchSequence]
    chosen: Chosen

    def ends(self, seq: BatchSequence) -> bool:
        """Whether the token ahead is `seq`'s last by count (so it takes no step after it)."""
        return seq in self.rows and seq.picker.ends_after(1)


def _chunks_fit(loaded: LoadedModel) -> bool:
    """Whether a prompt chunk can ride a step of this model: every layer attends to the whole sequence
    (a sliding window would need its own chunk mask) with an attention the chunk is masked for."""
    config = loaded.model.config
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return config._attn_implementation in MASKED_ATTENTION and all(kind == "full_attention" for kind in layer_types)


def _close_quietly(handle: CacheHandle) -> None:
    """Close a failed sequence's cache: an error closing it must not hide the error that failed it."""
    with contextlib.suppress(Exception):
        handle.close()
