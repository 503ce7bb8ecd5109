"""transformers' logits processors over many rows at once, each row with its own length, giving every
row exactly the scores the processor gives it alone.

Sharing a processor call would need padding, which changes what repetition penalties and n-gram bans
see. So each row keeps what its processor reads (`note`), and `apply` uses the processor's own
elementwise operations: bit for bit the row-alone value. Without such a form (`batched_form` is None)
a row stays on transformers' own call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitNormalization,
    LogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from runner.engine.step_inputs import step_inputs
from runner.engine.summary_ngrams import SummaryNoRepeatNGramLogitsProcessor
from runner.engine.word_pieces import WordPieces

SCORES_ONLY = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TopHLogitsWarper, MinPLogitsWarper,
               TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, LogitNormalization)
"""Processors whose result depends on each row's scores alone (not its input ids): one call over all rows."""


class BatchedForm(ABC):
    """One row's side of a processor. Rows whose forms have equal `key`s are processed together."""

    key: Hashable

    def note(self, token: int) -> None:
        """The row's next token was chosen."""

    @classmethod
    @abstractmethod
    def apply(cls, forms: Sequence[BatchedForm], scores: torch.Tensor) -> torch.Tensor:
        """`scores` ([rows, vocab], row i is forms[i]'s) as the processor leaves each row's."""


class ScoresOnly(BatchedForm):
    def __init__(self, processor: LogitsProcessor) -> None:
        self.processor = processor
        # equal settings: one call (a setting held as a tensor, e.g. eta's epsilon, compared by value)
        self.key = (type(processor), *((name, _hashable(value)) for name, value in sorted(vars(processor).items())))

    @classmethod
    def apply(cls, forms: Sequence[BatchedForm], scores: torch.Tensor) -> torch.Tensor:
        return forms[0].processor(None, scores)  # type: ignore[attr-defined]


class SeenTokensPenalty(BatchedForm):
    """RepetitionPenaltyLogitsProcessor: every token seen so far (prompt included) gets its score
    multiplied by the penalty when negative, divided by it otherwise; the row keeps a mask of them,
    made at its first step, when the width of the scores (the lm head's vocabulary) is known."""

    def __init__(self, penalty: float, tokens: list[int]) -> None:
        self.key = (type(self), penalty)
        self.penalty = penalty
        self.tokens: list[int] | None = list(tokens)  # until the mask is made
        self.seen: torch.Tensor | None = None  # [vocab] bool

    def note(self, token: int) -> None:
        if self.seen is None:
            self.tokens.append(token)  # type: ignore[union-attr]
        elif token < self.seen.shape[0]:
            self.seen[token] = True

    def _mask(self, scores: torch.Tensor) -> torch.Tensor:
        if self.seen is None:
            vocab = scores.shape[-1]
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
            # ids past the lm head's vocabulary cannot be chosen; transformers leaves them out too
            self.seen[step_inputs(scores.device).put(
                "seen tokens", [t for t in self.tokens if t < vocab])] = True  # type: ignore[union-attr]
            self.tokens = None
        return self.seen

    @classmethod
    def apply(cls, forms: Sequence[BatchedForm], scores: torch.Tensor) -> torch.Tensor:
        seen = torch.stack([f._mask(scores) for f in forms])  # type: ignore[attr-defined]  # [rows, vocab]
        penalty = forms[0].penalty  # type: ignore[attr-defined]
        return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


ANY = -1
"""A ban's `after` that holds whatever the row's previous token (no token id is negative)."""
Ban = list[tuple[int, list[int], bool]]
"""What `HostBans` forms do to a row's scores, as entries (after, banned, glued): after the row's
previous token `after` (ANY: any), its `banned` next tokens may not be taken, nor, with `glued`, its
word-continuing tokens. A step whose previous token is still on the device applies the entries that
token matches (`HostBans.banned_after_next`)."""


class HostBans(BatchedForm):
    """A processor that sets some tokens' scores to -inf by rules over the row's tokens, kept on the
    host: all rows' banned tokens become one mask. Rows share a call whatever their own parameters."""

    def __init__(self) -> None:
        self.key = type(self)

    @abstractmethod
    def banned(self) -> list[int]:
        """The tokens this row may not take next."""

    @abstractmethod
    def banned_after_next(self) -> dict[int, list[int]] | None:
        """The tokens this row may not take after its next one, by what that next one is (ANY: whatever
        it is; a token not among the keys brings no ban); None: too many to list."""

    @classmethod
    def apply(cls, forms: Sequence[BatchedForm], scores: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        vocab = scores.shape[-1]
        for row, form in enumerate(forms):
            banned = [t for t in form.banned() if t < vocab]  # type: ignore[attr-defined]
            rows += [row] * len(banned)
            tokens += banned
        if not rows:
            return scores
        mask = torch.zeros_like(scores, dtype=torch.bool)
        inputs = step_inputs(scores.device)
        mask[inputs.put("banned rows", rows), inputs.put("banned tokens", tokens)] = True
        return scores.masked_fill(mask, -float("inf"))


class NoRepeatNGrams(HostBans):
    """NoRepeatNGramLogitsProcessor: a token that would complete an n-gram already in the sequence
    (prompt included) is banned. The row keeps each (n-1)-gram's followers, so a step is one lookup.
    With `pieces` (the summary's ban, runner/engine/summary_ngrams.py), a row whose banned tokens
    include a word start also has every word-continuing token banned: one more masked fill a step."""

    def __init__(self, size: int, tokens: list[int], pieces: WordPieces | None = None) -> None:
        super().__init__()
        self.key = (type(self), id(pieces) if pieces is not None else None)
        self.size = size
        self.pieces = pieces
        self.tokens: list[int] = []
        self.followers: dict[tuple[int, ...], set[int]] = {}
        self.by_prefix: dict[tuple[int, ...], dict[int, set[int]]] = {}
        """`followers` by the (n-1)-gram's first n-2 tokens, then its last: the bans one token ahead."""
        for token in tokens:
            self.note(token)

    def note(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) >= self.size:
            gram = self.tokens[len(self.tokens) - self.size :]
            self.followers.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
            if self.size > 1:
                self.by_prefix.setdefault(tuple(gram[:-2]), {}).setdefault(gram[-2], set()).add(gram[-1])

    def banned_after_next(self) -> dict[int, list[int]] | None:
        """After a next token x the row's last n-1 tokens end in x: their followers, as `note(x)` would
        leave them (it adds the n-gram x completes, which a run of one repeated token looks up at once)."""
        size, count = self.size, len(self.tokens)
        if size == 1:
            return None  # every token seen, x too: not a short list by x
        if count + 1 < size:
            return {}
        prefix = tuple(self.tokens[count - size + 2 :]) if size > 2 else ()
        after = {x: set(followers) for x, followers in self.by_prefix.get(prefix, {}).items()}
        if count >= size - 1:  # the n-gram x completes: (last n-1 tokens) -> x, looked up after x when x
            completed = tuple(self.tokens[count - size + 1 :])  # continues a run that makes it the key
            if completed[:-1] == prefix:
                x = completed[-1]
                after.setdefault(x, set()).add(x)
        return {x: sorted(followers) for x, followers in after.items()}

    def banned(self) -> list[int]:
        if len(self.tokens) < self.size:
            return []
        return sorted(self.followers.get(tuple(self.tokens[len(self.tokens) - self.size + 1 :]), ()))

    def begins_word(self, banned: list[int]) -> bool:
        """Whether one of these banned tokens begins a word: then the word before it ends there, and a
        token carrying it on is banned too (the glue rule)."""
        return self.pieces is not None and any(t in self.pieces.starts for t in banned)

    @classmethod
    def apply(cls, forms: Sequence[BatchedForm], scores: torch.Tensor) -> torch.Tensor:
        scores = super().apply(forms, scores)
        vocab = scores.shape[-1]
        glued = [row for row, form in enumerate(forms)
                 if form.begins_word([t for t in form.banned() if t < vocab])]  # type: ignore[attr-defined]
        if not glued:
            return scores
        rows = torch.zeros(scores.shape[0], 1, dtype=torch.bool, device=scores.device)
        rows[step_inputs(scores.device).put("glued rows", glued)] = True
        continues = forms[glued[0]].pieces.mask("continues", scores)  # type: ignore[attr-defined]
        return scores.masked_fill(rows & continues, -float("inf"))


class TooShortForEos(HostBans):
    """MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor: the end-of-sequence tokens are
    banned while the sequence (or its new tokens) is shorter than the minimum."""

    def __init__(self, length: int, minimum: int, eos: list[int]) -> None:
        super().__init__()
        self.length, self.minimum, self.eos = length, minimum, eos

    def note(self, token: int) -> None:
        self.length += 1

    def banned(self) -> list[int]:
        return self.eos if self.length < self.minimum else []

    def banned_after_next(self) -> dict[int, list[int]]:
        return {ANY: self.eos} if self.length + 1 < self.minimum else {}


def batched_form(processor: LogitsProcessor, tokens: list[int]) -> BatchedForm | None:
    """The row's batched form of `processor` given its tokens so far (the prompt), or None when it has none."""
    kind = type(processor)
    if kind in SCORES_ONLY:
        return ScoresOnly(processor)
    if kind is RepetitionPenaltyLogitsProcessor and processor.prompt_ignore_length is None:
        return SeenTokensPenalty(processor.penalty, tokens)
    if kind is NoRepeatNGramLogitsProcessor:
        return NoRepeatNGrams(processor.ngram_size, tokens)
    if kind is SummaryNoRepeatNGramLogitsProcessor:  # the same rule over the new tokens: the table starts empty
        return NoRepeatNGrams(processor.ngram_size, [], processor.pieces)
    if kind is MinLengthLogitsProcessor:
        return TooShortForEos(len(tokens), processor.min_length, _ids(processor.eos_token_id))
    if kind is MinNewTokensLengthLogitsProcessor:
        return TooShortForEos(len(tokens) - processor.prompt_length_to_skip, processor.min_new_tokens,
                              _ids(processor.eos_token_id))
    return None


def _hashable(value: Any) -> Hashable:
    return tuple(value.flatten().tolist()) if isinstance(value, torch.Tensor) else value


def _ids(eos: Any) -> list[int]:
    return eos.flatten().tolist() if isinstance(eos, torch.Tensor) else list(eos)
