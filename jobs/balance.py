"""Balancing the workers: tasks go out by the work they are expected to take, not by arrival order.

A batch ends when its busiest worker does, so the longest expected task goes first, to the worker with
the least expected work in flight (greedy LPT). Work is estimated from characters until a document is
planned, then from its passes' real prompts (prefill plus weighted decode tokens).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

from jobs.chunking import fewest_chunks, group_for_merge
from jobs.config import JobConfig
from jobs.kvplan import CHARS_PER_TOKEN, PROMPT_TOKENS
from jobs.task import Task

#: Tokens of jobs.chunking.SUMMARY_SEPARATOR ("\n\n") between two summaries a merge joins, in most tokenizers.
SEPARATOR_TOKENS = 1
#: What one decoded token costs in prefilled tokens: prefill runs a whole chunk per forward pass,
#: decode one token per sequence per step (shared by the batch's rows, so far less than a full step).
DECODE_TOKEN_WEIGHT = 4.0


def pass_counts(doc_tokens: int, context_tokens: int, max_new_tokens: int, overlap_tokens: int) -> list[int]:
    """Document tokens of each pass a summary takes: its chunks, then each merge of their summaries, as
    jobs/chunking.py cuts and groups them (the fewest chunks, every summary `max_new_tokens` long)."""
    budget = _pass_budget(context_tokens, max_new_tokens)
    if doc_tokens <= budget:
        return [doc_tokens]
    summaries = fewest_chunks(doc_tokens, budget, overlap_tokens)
    passes = [budget] * summaries
    # merge rounds as runner/engine/summarize.py runs them: a group of one is carried over, the others merge;
    # never too small for two: preflight checked that two summaries merge at every context the job uses
    merge_budget = max(budget, 2 * max_new_tokens + SEPARATOR_TOKENS)
    while summaries > 1:
        groups = group_for_merge([max_new_tokens] * summaries, merge_budget, SEPARATOR_TOKENS)
        passes += [len(g) * (max_new_tokens + SEPARATOR_TOKENS) - SEPARATOR_TOKENS for g in groups if len(g) > 1]
        summaries = len(groups)
    return passes


def _pass_budget(context_tokens: int, max_new_tokens: int) -> int:
    return max(1, context_tokens - PROMPT_TOKENS - max_new_tokens)


def _max_new_tokens(task: Task, config: JobConfig) -> int:
    return int(task.overrides.get("max_new_tokens", config.summarize.max_new_tokens))


def expected_passes(task: Task, config: JobConfig, context_tokens: int | None = None) -> list[int]:
    """Document tokens of each pass the task is expected to take at `context_tokens` (the configured
    context unless it was moved to a shorter one): one for a document that fits."""
    summarize = config.summarize
    return pass_counts(task.n_chars // CHARS_PER_TOKEN, context_tokens or summarize.context_tokens,
                       _max_new_tokens(task, config), summarize.chunk_overlap_tokens)


def expected_decode_tokens(task: Task, config: JobConfig) -> int:
    """The most tokens a task's passes decode at the configured context: what the progress line's ETA
    counts down with the tokens decoded so far (a summary that stops early frees the rest)."""
    return len(expected_passes(task, config)) * _max_new_tokens(task, config)


def pass_work(task: Task, config: JobConfig, prompt_tokens: int) -> float:
    """One pass's expected work in prefilled-token units: its prompt plus its weighted decode."""
    return prompt_tokens + _max_new_tokens(task, config) * DECODE_TOKEN_WEIGHT


def expected_work(task: Task, config: JobConfig, context_tokens: int | None = None) -> float:
    """A task's expected work: that of every pass it is expected to take."""
    return sum(pass_work(task, config, tokens + PROMPT_TOKENS)
               for tokens in expected_passes(task, config, context_tokens))


def may_take(worker: Hashable, loads: Mapping[Hashable, float], free: Collection[Hashable]) -> bool:
    """Whether `worker` takes the next task now: no other worker that has a free slot has less work in
    flight (a worker with every slot busy, or down, does not hold the task back from the others)."""
    return all(loads.get(worker, 0.0) <= loads.get(other, 0.0) for other in free)


class Item(Protocol):
    """A work item: a document to plan or a pass to run (runner/coordinator.py)."""

    @property
    def doc(self) -> object: ...  # its document: one document's items prefer one worker

    @property
    def work(self) -> float: ...  # its expected work


class WorkQueue:
    """Work items shared by the workers' feeding threads (docs/cluster.md, "Running on a Ray cluster").
    Documents wait in `later`, the longest first; everything else goes in front, a planned document's passes
    to the worker that holds its other passes when it may take them, so they batch together."""

    def __init__(self, later: list[Item], workers: list[Hashable], slots: int,
                 is_down: Callable[[Hashable], bool]) -> None:
        self._order = itertools.count()
        self._later = [self._entry(item) for item in later]
        heapq.heapify(self._later)
        self._front: list[tuple[float, int, Item]] = []
        self._held: dict[Hashable, list[Item]] = {w: [] for w in workers}
        self._slots = slots
        self._is_down = is_down
        self._changed = threading.Condition()

    def _entry(self, item: Item) -> tuple[float, int, Item]:
        return -item.work, next(self._order), item

    def _load(self, worker: Hashable) -> float:
        return sum(item.work for item in self._held[worker])

    @contextmanager
    def taking(self, worker: Hashable, stop: threading.Event) -> Iterator[Item | None]:
        """The next item for `worker`, held by it until the block ends or it is handed back; None once
        none is left and none can come (or the batch stops)."""
        item = self._take(worker, stop)
        try:
            yield item
        finally:
            if item is not None:
                with self._changed:
                    self._held[worker].remove(item)
                    self._changed.notify_all()

    def _take(self, worker: Hashable, stop: threading.Event) -> Item | None:
        with self._changed:
            while not stop.is_set():
                if self._front or self._later:
                    free = [w for w, held in self._held.items() if len(held) < self._slots and not self._is_down(w)]
                    if may_take(worker, {w: self._load(w) for w in self._held}, free):
                        item = self._pop(worker)
                        self._held[worker].append(item)
                        self._changed.notify_all()
                        return item
                elif not any(self._held.values()):
                    return None
                self._changed.wait(0.2)
            return None

    def _pop(self, worker: Hashable) -> Item:
        """In front, the first item whose document this worker holds (among the first `slots`), else the first."""
        if not self._front:
            return heapq.heappop(self._later)[-1]
        mine = {id(item.doc) for item in self._held[worker]}
        near = heapq.nsmallest(self._slots, self._front)
        entry = next((e for e in near if id(e[-1].doc) in mine), near[0])
        self._front.remove(entry)
        heapq.heapify(self._front)
        return entry[-1]

    def put(self, items: list[Item]) -> None:
        """Items for any worker, in front of the documents not planned yet."""
        with self._changed:
            for item in items:
                heapq.heappush(self._front, self._entry(item))
            self._changed.notify_all()

    def load(self, worker: Hashable) -> float:
        """The expected work of the items `worker` holds now."""
        with self._changed:
            return self._load(worker)

    def drained(self) -> bool:
        """Nothing left to run and nothing in flight that could bring more."""
        with self._changed:
            return not self._front and not self._later and not any(self._held.values())

    def left(self) -> int:
        """Documents with work not run (a document counted once, however many of its items wait)."""
        with self._changed:
            return len({id(e[-1].doc) for e in self._front + self._later})
