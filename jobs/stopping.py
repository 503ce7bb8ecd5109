"""Why a generated sequence ended, and the loop stop: a sequence whose tail repeats itself ends there.

Greedy decoding of a small model often loops until `max_new_tokens` (docs/summaries.md). Exact loops are
`repeated_tail`'s; near-copies with a word changed are `LoopWatch`'s, by the share of recent n-grams
already seen. Stopping there saves the decode steps of text a reader throws away.
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
    one block of `rule.ngram` to `rule.max_period` tokens (all copies but the first; the shortest block
    wins); 0 when they do not, or the rule is off."""
    if not rule.enabled:
        return 0
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
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0  # every occurrence but a gram's first


class LoopWatch:
    """The loop stop for one sequence, fed its tokens as they are generated; it keeps counts so a step
    costs one n-gram lookup (and `repeated_tail` only when that n-gram occurred before), not a rescan
    of the sequence."""

    def __init__(self, rule: LoopStopConfig) -> None:
        self.rule = rule
        self.tokens: list[int] = []
        self.cut = 0  # tokens to cut once the sequence has looped; 0 while it has not
        self._seen: set[tuple[int, ...]] = set()  # every n-gram so far
        self._repeated: list[bool] = []  # per n-gram, by where it begins: did it occur before?
        self._span = max(rule.window - rule.ngram + 1, 1)  # the n-grams inside the last `window` tokens
        self._recent_repeated = 0  # how many of those did

    def update(self, tokens: Sequence[int]) -> int:
        """Take the tokens of `tokens` not fed yet (it is the whole sequence so far) and say how many to
        cut from its end (at most what was fed when it looped); 0 while it does not loop."""
        if not self.rule.enabled:
            return 0
        for token in tokens[len(self.tokens):]:
            if self.cut:
                break
            self.tokens.append(token)
            # a tail of copies ends in an n-gram seen before, so only then is the exact rule run
            repeated = self._note_newest_gram()
            self.cut = (repeated_tail(self.tokens, self.rule) if repeated else 0) or self._near_copy()
        return self.cut

    def kept(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` (the whole sequence) without the looped tail, once fed."""
        cut = self.update(tokens)
        return self.tokens[: len(self.tokens) - cut] if cut else list(tokens)

    def _note_newest_gram(self) -> bool:
        """Record the n-gram the newest token completes; whether it occurred before."""
        flags, begin = self._repeated, len(self.tokens) - self.rule.ngram
        if begin < 0:
            return False
        gram = tuple(self.tokens[begin:])
        flags.append(gram in self._seen)
        self._seen.add(gram)
        self._recent_repeated += flags[-1] - (flags[-self._span - 1] if len(flags) > self._span else 0)
        return flags[-1]

    def _near_copy(self) -> int:
        if (not self.rule.window or len(self._repeated) < self._span
                or self._recent_repeated < self.rule.window_share * self._span):
            return 0
        return len(self.tokens) - self._copy_start()

    def _copy_start(self) -> int:
        """Where the copy began: the earliest repeated n-gram of the window from which on the share holds,
        then back over the changes inside the copy (a run of at most 2 x `ngram` new n-grams: a word
        changed, or a line break, which also changes the next word's token), up to a longer run of new
        text, which is the first copy's."""
        flags, share = self._repeated, self.rule.window_share
        longest_change = 2 * self.rule.ngram
        start, repeated = len(flags), 0
        for i in range(len(flags) - 1, len(flags) - self._span - 1, -1):
            repeated += flags[i]
            if flags[i] and repeated >= share * (len(flags) - i):
                start = i
        while True:
            while start > 0 and flags[start - 1]:
                start -= 1
            gap = 0
            while gap <= longest_change and start - gap > 0 and not flags[start - gap - 1]:
                gap += 1
            if gap > longest_change or start - gap == 0:
                return start
            start -= gap


def loop_stopped(tokens: Sequence[int], rule: LoopStopConfig) -> tuple[list[int], bool]:
    """What a sequence keeps when the loop stop watches it token by token (as the batched decode does),
    and whether it stopped: for tokens generated without it, e.g. by a plain generate() call."""
    watch = LoopWatch(rule)
    return watch.kept(tokens), bool(watch.cut)
