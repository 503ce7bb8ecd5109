"""Balancing the workers: tasks go out by the work they are expected to take, not by arrival order.

A batch ends when its busiest worker does, so the longest expected task goes first, to the worker
with the least expected work in flight (greedy longest-processing-time scheduling). A task's work is
estimated before it is tokenised, with the planner's characters-per-token (jobs/kvplan.py): the
tokens it prefills over all its passes (chunks, then merge rounds of their summaries) plus the
tokens it decodes, weighted, since a decoded token costs one forward step of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from math import ceil

from jobs.config import JobConfig
from jobs.kvplan import CHARS_PER_TOKEN, PROMPT_TOKENS
from jobs.task import Task

#: What one decoded token costs in prefilled tokens: prefill runs a whole chunk per forward pass,
#: decode one token per sequence per step (shared by the batch's rows, so far less than a full step).
DECODE_TOKEN_WEIGHT = 4.0


def chunk_count(doc_tokens: int, budget_tokens: int, overlap_tokens: int) -> int:
    """About how many chunks jobs/chunking.py cuts: each brings its budget less the overlap."""
    if doc_tokens <= budget_tokens:
        return 1
    overlap = min(overlap_tokens, budget_tokens // 4)
    return ceil((doc_tokens - overlap) / (budget_tokens - overlap))


def pass_counts(doc_tokens: int, context_tokens: int, max_new_tokens: int, overlap_tokens: int) -> list[int]:
    """Document tokens of each pass a summary takes: its chunks, then each merge of their summaries.

    Mirrors jobs/chunking.py in the large: chunks of the pass budget overlapping by `overlap_tokens`
    (capped at a quarter of the budget), and merges of as many `max_new_tokens` summaries as fit.
    """
    budget = _pass_budget(context_tokens, max_new_tokens)
    if doc_tokens <= budget:
        return [doc_tokens]
    chunks = chunk_count(doc_tokens, budget, overlap_tokens)
    return [budget] * chunks + merge_counts(chunks, context_tokens, max_new_tokens)


def merge_counts(chunks: int, context_tokens: int, max_new_tokens: int) -> list[int]:
    """Document tokens of each merge pass that `chunks` summaries take: as many as fit in one pass."""
    per_merge = max(2, _pass_budget(context_tokens, max_new_tokens) // max(1, max_new_tokens))
    passes: list[int] = []
    summaries = chunks
    while summaries > 1:  # a group of one is carried over as it is, the others merge in one pass each
        groups = [per_merge] * (summaries // per_merge) + ([summaries % per_merge] if summaries % per_merge else [])
        passes += [size * max_new_tokens for size in groups if size > 1]
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


def merge_work(task: Task, config: JobConfig, chunks: int, context_tokens: int) -> float:
    """The expected work left to a task whose `chunks` ran dealt out: its merge passes."""
    return sum(pass_work(task, config, tokens + PROMPT_TOKENS)
               for tokens in merge_counts(chunks, context_tokens, _max_new_tokens(task, config)))


def may_take(worker: Hashable, loads: Mapping[Hashable, float], free: Collection[Hashable]) -> bool:
    """Whether `worker` takes the next task now: no other worker that has a free slot has less work in
    flight (a worker with every slot busy, or down, does not hold the task back from the others)."""
    return all(loads.get(worker, 0.0) <= loads.get(other, 0.0) for other in free)

