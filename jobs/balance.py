"""Balancing the workers: tasks go out by the work they are expected to take, not by arrival order.

A batch ends when its busiest worker does, so the longest expected task goes first, to the worker
with the least expected work in flight (greedy longest-processing-time scheduling). A task's work is
estimated before it is tokenised, with the planner's characters-per-token (jobs/kvplan.py): the
tokens it prefills over all its passes (its chunks, then merge rounds of their summaries, as
jobs/chunking.py cuts and groups them) plus the tokens it decodes, weighted, since a decoded token
costs one forward step of its own. Once a document is planned, its real chunk prompts count instead
(runner/coordinator.py `work_of`).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping

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
    chunks = fewest_chunks(doc_tokens, budget, overlap_tokens)
    return [budget] * chunks + merge_counts(chunks, context_tokens, max_new_tokens)


def merge_counts(chunks: int, context_tokens: int, max_new_tokens: int) -> list[int]:
    """Document tokens of each merge pass that `chunks` summaries of `max_new_tokens` take, round by round
    as runner/engine/summarize.py merges them: a group of one is carried over, the others merge."""
    # never too small for two: preflight checked that two summaries merge at every context the job uses
    budget = max(_pass_budget(context_tokens, max_new_tokens), 2 * max_new_tokens + SEPARATOR_TOKENS)
    passes: list[int] = []
    summaries = chunks
    while summaries > 1:
        groups = group_for_merge([max_new_tokens] * summaries, budget, SEPARATOR_TOKENS)
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


def merge_work(task: Task, config: JobConfig, chunks: int, context_tokens: int) -> float:
    """The expected work left to a task whose `chunks` ran dealt out: its merge passes."""
    return sum(pass_work(task, config, tokens + PROMPT_TOKENS)
               for tokens in merge_counts(chunks, context_tokens, _max_new_tokens(task, config)))


def may_take(worker: Hashable, loads: Mapping[Hashable, float], free: Collection[Hashable]) -> bool:
    """Whether `worker` takes the next task now: no other worker that has a free slot has less work in
    flight (a worker with every slot busy, or down, does not hold the task back from the others)."""
    return all(loads.get(worker, 0.0) <= loads.get(other, 0.0) for other in free)

