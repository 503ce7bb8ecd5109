"""Why a generated sequence ended, and the loop stop: a sequence whose tail repeats itself ends there.

Greedy decoding of a small model often falls into a loop (the same sentence again and again until
`max_new_tokens`). Such a loop is exact: once the model emits the same block of tokens `repeats`
times back to back, it keeps doing so. `repeated_tail` spots that at the step it happens, so the
sequence stops paying decode steps for text a reader throws away, and says how many tokens to cut
so the summary keeps the block once. Pure: no torch, called once per decode step per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from jobs.config import LoopStopConfig


class StopReason(StrEnum):
    EOS = "eos"  # the model's end-of-sequence token
    LENGTH = "length"  # max_new_tokens
    REPETITION = "repetition"  # the loop stop
    STOP_STRING = "stop_string"


def repeated_tail(tokens: Sequence[int], rule: LoopStopConfig) -> int:
    """Tokens to cut from the end of `tokens` when they end in `rule.repeats` back-to-back copies of
    one block of `rule.ngram` to `rule.max_period` tokens (all copies but the first); 0 when they do
    not, or the rule is off.

    The shortest such block wins. A loop of a shorter block (a word repeated) is caught too, as soon
    as it spans `repeats` copies of `ngram` tokens.
    """
    if not rule.enabled:
        return 0
    tokens = list(tokens)
    n, repeats = len(tokens), rule.repeats
    for period in range(rule.ngram, min(rule.max_period, n // repeats) + 1):
        span = period * repeats
        # periodic with `period` over the last `span` tokens: each token equals the one `period` earlier
        if tokens[n - span : n - period] == tokens[n - span + period :]:
            return period * (repeats - 1)
    return 0


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of a text's `n`-grams that already occurred earlier in it: 0 for text that never
    repeats itself, near 1 for a loop. What the bench reports to show how much of a summary loops."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(grams) if grams else 0.0


def loop_stopped(tokens: Sequence[int], rule: LoopStopConfig) -> tuple[list[int], bool]:
    """What a sequence keeps when the loop stop watches it token by token (as the batched decode does),
    and whether it stopped: for tokens generated without it, e.g. by a plain generate() call."""
    tokens = list(tokens)
    for end in range(1, len(tokens) + 1):
        cut = repeated_tail(tokens[:end], rule)
        if cut:
            return tokens[: end - cut], True
    return tokens, False
