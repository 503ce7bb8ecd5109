"""What the worker's batch runs next, with no model in it: sequences, their status, admission, splitting.

The engine asks `schedule()` whom to prefill, runs the step and hands the outcome back (`decoded`,
`split`, `wait_for_room`, `leave`). Plain Python, so every rule is tested without a model
(tests/test_batch_plan.py). The statuses and admission rule: docs/kv-cache.md, "Batched decode steps".
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from jobs.batch_limit import GROW_BACK_STEPS, BatchLimit
from jobs.config import LoopStopConfig
from jobs.outcome import DecodeSteps, no_steps
from jobs.stopping import LoopWatch, StopReason


class Status(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False)
class BatchSequence:
    """One sequence of the batch: its request and future, and the state of its current attempt (a
    split sends it back to WAITING, and its next attempt starts from its prompt again)."""

    request: Any  # the engine's PassRequest: admission reads its prompt_ids, device_bytes, host_bytes, fits
    future: Future[Any]
    loop_stop: LoopStopConfig
    status: Status = Status.WAITING
    handle: Any = None  # its cache (a CacheHandle), while PREFILLING or DECODING
    picker: Any = None  # its TokenPicker (runner/engine/generation.py), while PREFILLING or DECODING
    tokens: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in its cache
    chunk_tokens: int = 0  # its prompt rides the decode steps this many tokens at a time (0: prefilled whole)
    started: float = 0.0
    first_token_at: float = 0.0
    steps: int = 0  # decode steps it took part in
    decode_steps: DecodeSteps = field(default_factory=no_steps)  # them by path: static (ahead of them), eager by why
    rows_seen: int = 0  # sum over its decode steps of the decode rows in the step
    watch: LoopWatch = field(init=False, repr=False)  # made by `begin`, before its first token

    @property
    def position(self) -> int:
        """Position of the next token to feed: after the prompt and every token chosen but the last."""
        return len(self.request.prompt_ids) + len(self.tokens) - 1

    def begin(self) -> None:
        """A new attempt: nothing in its cache, no token yet."""
        self.status = Status.PREFILLING
        self.handle, self.picker = None, None
        self.tokens, self.prefilled, self.chunk_tokens, self.steps, self.rows_seen = [], 0, 0, 0, 0
        self.decode_steps = no_steps()
        self.watch = LoopWatch(self.loop_stop)
        self.started = time.perf_counter()

    def take(self, token: int) -> None:
        """Its next token (the first one ends its prefill)."""
        if not self.tokens:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)

    def stop_reason(self) -> StopReason | None:
        """Why the sequence ends after its latest token; None while it goes on."""
        assert self.picker is not None, "a sequence without a token picker has no token yet"
        if self.picker.done:  # generate()'s own stopping criteria
            return self.picker.stop_reason(self.tokens)
        if self.watch.update(self.tokens):
            return StopReason.REPETITION
        return None

    def kept_tokens(self) -> list[int]:
        """Its tokens without the looped tail the loop stop cuts."""
        return self.watch.kept(self.tokens)

    @property
    def batch_size(self) -> float:
        """Mean decode rows of the steps it decoded in."""
        return self.rows_seen / self.steps if self.steps else 1.0


class BatchPlan:
    """The worker's sequences and the rules that say which run; not thread-safe (its owner locks)."""

    def __init__(self, max_sequences: int, device_budget: int, host_budget: int | None = None,
                 grow_back_steps: int = GROW_BACK_STEPS) -> None:
        """`host_budget`: the worker's host RAM for KV (None: not limited here); `grow_back_steps`:
        calm decode steps before a limit a memory error lowered doubles back (jobs.batch_limit)."""
        self.limit = BatchLimit(max_sequences, grow_back_steps)
        self.device_budget = device_budget
        self.host_budget = host_budget
        self.waiting: deque[BatchSequence] = deque()
        self.running: list[BatchSequence] = []  # PREFILLING and DECODING, in the order they joined
        self.splits = 0
        """How often a memory error split a batch (each split halves the limit)."""
        self.most_rows = 0
        """The most rows one decode step has run: what a test asks to know batching happened."""
        self.decode_steps = 0
        """Decode steps run."""
        self.tokens_decoded = 0
        """Tokens its decode steps have made (one a row a step): the progress line's live tok/s."""
        self.steps_with_prefill = 0
        """Decode steps whose forward pass carried a prefill chunk beside the decode rows."""
        self.static_row_steps = 0
        """Row-steps (a row in a decode step) through the static step."""
        self.eager_row_steps: Counter[str] = Counter()
        """The other row-steps, by why they ran eagerly."""

    @property
    def decoding(self) -> list[BatchSequence]:
        return [seq for seq in self.running if seq.status is Status.DECODING]

    @property
    def prefilling(self) -> BatchSequence | None:
        return next((seq for seq in self.running if seq.status is Status.PREFILLING), None)

    def add(self, seq: BatchSequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> BatchSequence | None:
        """The sequence to prefill next: the one prefilling, else the next one admissible now (it begins)."""
        prefill = self.prefilling
        if prefill is None and self.waiting and self._admissible(self.waiting[0].request):
            prefill = self.waiting.popleft()
            prefill.begin()
            self.running.append(prefill)
        return prefill

    def _admissible(self, head: Any) -> bool:
        if not self.running:  # alone, a sequence always runs: its own memory error moves its task down the ladder
            return True
        if len(self.running) >= self.limit.current:
            return False
        if head.fits is not None and not head.fits():  # the pool owns the device KV: it says
            return False
        if sum(seq.request.device_bytes for seq in self.running) + head.device_bytes > self.device_budget:
            return False
        return (self.host_budget is None
                or sum(seq.request.host_bytes for seq in self.running) + head.host_bytes <= self.host_budget)

    @staticmethod
    def next_chunk(seq: BatchSequence) -> tuple[int, int]:
        """The prompt tokens [start, end) that ride the next step of a sequence prefilling in chunks."""
        assert seq.chunk_tokens > 0, "a sequence prefilled whole has no chunks"
        return seq.prefilled, min(seq.prefilled + seq.chunk_tokens, len(seq.request.prompt_ids))

    def joined(self, seq: BatchSequence) -> None:
        """Its prompt is in its cache and its first token chosen: it decodes from the next step on."""
        seq.status = Status.DECODING

    def decoded(self, rows: list[BatchSequence], beside_prefill: bool = False,
                eager_because: Sequence[str | None] = (), ahead: Sequence[bool] = ()) -> None:
        """A decode step over `rows` ran without a memory error (with a prefill chunk beside them when
        `beside_prefill`): each took one step; the limit may grow. `eager_because`: each row's reason
        for the eager step, None for a row the static step ran (not given: no path counted); `ahead`:
        whether each row's input came from the device (the step launched before the last was read)."""
        self.limit.step()
        self.decode_steps += 1
        self.tokens_decoded += len(rows)
        self.steps_with_prefill += beside_prefill
        self.most_rows = max(self.most_rows, len(rows))
        for seq in rows:
            seq.steps += 1
            seq.rows_seen += len(rows)
        for seq, why in zip(rows, eager_because, strict=False):
            if why is None:
                seq.decode_steps["static"] += 1
                self.static_row_steps += 1
            else:
                eager = seq.decode_steps["eager"]
                eager[str(why)] = eager.get(str(why), 0) + 1
                self.eager_row_steps[why] += 1
        for seq, went_ahead in zip(rows, ahead, strict=False):
            seq.decode_steps["ahead"] += went_ahead

    def leave(self, seq: BatchSequence, status: Status) -> None:
        """`seq` is FINISHED or FAILED: out of the batch."""
        if seq in self.running:
            self.running.remove(seq)
        assert status in (Status.FINISHED, Status.FAILED), f"a sequence leaves finished or failed, not {status}"
        seq.status = status

    def wait_for_room(self, seq: BatchSequence) -> bool:
        """A memory error starting `seq` (its cache, its prefill): with others running it waits for a
        smaller batch (the limit drops to those others) and True; alone it is its task's error: False."""
        others = [s for s in self.running if s is not seq]
        if not others:
            return False
        self.limit.lower_to(len(others))
        self.requeue([seq])
        return True

    def split(self, rows: list[BatchSequence]) -> None:
        """Too many sequences for the memory: all of `rows` start again, at most half as many at a time."""
        self.splits += 1
        self.limit.lower_to(len(rows) // 2)
        self.requeue(rows)

    def requeue(self, rows: list[BatchSequence]) -> None:
        """Back to the front of the queue, in their order (their caches are the caller's to close)."""
        for seq in rows:
            if seq in self.running:
                self.running.remove(seq)
            seq.status, seq.handle = Status.WAITING, None
        self.waiting.extendleft(reversed(rows))

    def drain(self) -> list[BatchSequence]:
        """Every sequence, waiting or running, taken out (they are failed together)."""
        everyone = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        for seq in everyone:
            seq.status = Status.FAILED
        return everyone
