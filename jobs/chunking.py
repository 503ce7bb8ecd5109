"""Planning how a document too long for one pass is cut into chunks, and how their summaries merge.

Chunks end at the most natural boundary (paragraph, sentence, line, word, else between two tokens) and
overlap, so a thought cut at a boundary keeps its context. Planned on the token offsets of one
tokenisation of the whole document, so the budgets are exact.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil

#: Summaries are joined with a blank line, so a later split falls between two of them.
SUMMARY_SEPARATOR = "\n\n"

# Whitespace that separates two pieces of text, strongest first. Each pattern starts at a fixed
# character (no leading `\s*`), so hostile runs of whitespace cannot make matching quadratic.
_BREAKS = (
    re.compile(r"\n[^\S\n]*\n\s*"),  # paragraph: a blank line
    re.compile(r"(?<=[.!?…])[\"'”’»)\]]*\s+"),  # sentence: terminal punctuation, closing quotes
    re.compile(r"\n\s*"),  # line
    re.compile(r"\s+"),  # word
)


class ContextTooSmallError(ValueError):
    """The context cannot hold the prompt, the answer and any of the document."""


@dataclass(frozen=True)
class Chunk:
    start_token: int  # first token of the chunk
    end_token: int  # one past its last token
    text: str  # the document's text from the chunk's first token to its last


def summary_budget(context_tokens: int, prompt_tokens: int, max_new_tokens: int) -> int:
    """Document tokens that fit one pass beside the prompt (chat template included) and the answer."""
    budget = context_tokens - prompt_tokens - max_new_tokens
    if budget <= 0:
        raise ContextTooSmallError(
            f"a context of {context_tokens} tokens leaves no room for the document after the prompt "
            f"({prompt_tokens} tokens) and max_new_tokens ({max_new_tokens}): raise "
            "summarize.context_tokens, or lower summarize.max_new_tokens or shorten the prompt"
        )
    return budget


def merge_room(context_tokens: int, prompt_tokens: int, max_new_tokens: int, separator_tokens: int) -> int:
    """Tokens a merge pass of `context_tokens` has to spare once it holds the prompt, its answer and two
    partial summaries of `max_new_tokens` each; negative: a document longer than one pass could never end."""
    return context_tokens - prompt_tokens - max_new_tokens - (2 * max_new_tokens + separator_tokens)


def _check_spans(text: str, token_spans: Sequence[tuple[int, int]]) -> None:
    previous_start = 0
    for i, (start, end) in enumerate(token_spans):
        if not 0 <= start <= end <= len(text) or start < previous_start:
            raise ValueError(
                f"token {i} has span ({start}, {end}), which is not an ordered offset into the text "
                f"of {len(text)} characters: tokenise without special tokens and with return_offsets_mapping"
            )
        previous_start = start


def _boundaries(text: str, token_spans: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Per break level (strongest first): sorted token indices i where a chunk may end before token i: a
    whitespace run allows a cut before the first token starting in it when the token before ends in it
    (whether tokenizers keep whitespace as tokens, glue it to the next word, or drop it)."""
    starts = [start for start, _ in token_spans]
    n = len(token_spans)
    levels = []
    for pattern in _BREAKS:
        cuts = set()
        for match in pattern.finditer(text):
            i = bisect_left(starts, match.start())
            if 0 < i < n and token_spans[i - 1][1] <= match.end():
                cuts.add(i)
        levels.append(sorted(cuts))
    return levels


def _best_cut(levels: list[list[int]], lo: int, hi: int, fallback: int) -> int:
    """The latest cut in [lo, hi] at the strongest level that has one, else `fallback`."""
    for cuts in levels:
        k = bisect_right(cuts, hi) - 1
        if k >= 0 and cuts[k] >= lo:
            return cuts[k]
    return fallback


def plan_chunks(
    text: str, token_spans: Sequence[tuple[int, int]], budget_tokens: int, overlap_tokens: int
) -> list[Chunk]:
    """Cut a tokenised text into chunks of at most `budget_tokens` tokens that cover every token.

    `token_spans` are each token's (start_char, end_char) in `text`. A chunk fills at least half the budget
    before a cut is looked for; consecutive chunks share `overlap` to 2 × `overlap` tokens (`overlap_tokens`
    capped at a quarter of the budget, so each chunk brings mostly new text).
    """
    if budget_tokens <= 0:
        raise ValueError(f"budget_tokens must be positive, got {budget_tokens}")
    if overlap_tokens < 0:
        raise ValueError(f"overlap_tokens must not be negative, got {overlap_tokens}")
    _check_spans(text, token_spans)
    n = len(token_spans)
    if n <= budget_tokens:
        return [Chunk(0, n, text)]
    levels = _boundaries(text, token_spans)
    overlap = min(overlap_tokens, budget_tokens // 4)

    def chunk(start: int, end: int) -> Chunk:
        return Chunk(start, end, text[token_spans[start][0] : token_spans[end - 1][1]])

    chunks: list[Chunk] = []
    start, previous_end = 0, 0
    while n - start > budget_tokens:
        hi = start + budget_tokens
        lo = max(start + max(1, budget_tokens // 2), previous_end + 1)
        end = _best_cut(levels, lo, hi, fallback=hi)
        chunks.append(chunk(start, end))
        next_start = _best_cut(levels, max(start + 1, end - 2 * overlap), end - overlap, fallback=end - overlap)
        start, previous_end = next_start, end
    chunks.append(chunk(start, n))
    return chunks


def fewest_chunks(n_tokens: int, budget_tokens: int, overlap_tokens: int) -> int:
    """How many chunks `plan_chunks` cuts `n_tokens` into where a cut may fall anywhere (a text with fewer
    places to cut takes more): what a document is expected to take before it is tokenised (jobs/balance.py)."""
    if n_tokens <= budget_tokens:
        return 1
    overlap = min(overlap_tokens, budget_tokens // 4)
    return ceil((n_tokens - overlap) / (budget_tokens - overlap))


def group_for_merge(token_counts: Sequence[int], budget_tokens: int, separator_tokens: int) -> list[range]:
    """Pack consecutive summaries into groups that each fit one pass when joined with SUMMARY_SEPARATOR.

    A group of one is carried over as it is; ContextTooSmallError when no two neighbours fit together,
    since merging could then never end.
    """
    groups: list[range] = []
    first, used = 0, 0
    for i, count in enumerate(token_counts):
        if i > first and used + separator_tokens + count > budget_tokens:
            groups.append(range(first, i))
            first, used = i, count
        else:
            used += (separator_tokens if i > first else 0) + count
    if len(token_counts) > first:
        groups.append(range(first, len(token_counts)))
    if len(token_counts) > 1 and all(len(g) == 1 for g in groups):
        raise ContextTooSmallError(
            f"no two of the {len(token_counts)} partial summaries ({min(token_counts)}+ tokens each) fit "
            f"together in {budget_tokens} tokens: lower summarize.max_new_tokens or raise summarize.context_tokens"
        )
    return groups
