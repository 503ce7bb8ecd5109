"""A ban on repeated n-grams within the summary only (`summarize.no_repeat_summary_ngram`).

transformers' `no_repeat_ngram_size` reads the whole sequence, so on a decoder-only model it would ban
the prompt's n-grams too; this applies its rule to the new tokens alone, in generate() and in the
engine's `TokenPicker` (batched form: batched_logits.py `NoRepeatNGrams`). A banned repeat is banned in
both spellings (word_pieces.py). Why, with examples: docs/summaries.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList, NoRepeatNGramLogitsProcessor

from jobs.config import SummarizeConfig
from runner.engine.word_pieces import WordPieces

if TYPE_CHECKING:
    from runner.engine.model_loader import LoadedModel


class SummaryNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Bans a token that would complete an `ngram_size`-gram already among the tokens after the first
    `prompt_length` (the summary so far); the prompt's n-grams stay allowed. With `pieces`, a ban of a
    token that begins a word also bans every token that would glue on to the word before it."""

    def __init__(self, ngram_size: int, prompt_length: int, pieces: WordPieces | None = None) -> None:
        self.rule = NoRepeatNGramLogitsProcessor(ngram_size)  # raises for a size that is not positive
        self.ngram_size = ngram_size
        self.prompt_length = prompt_length
        self.pieces = pieces

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        # what transformers' rule bans, whatever the scores held before (zeros have no -inf of their own)
        summary = input_ids[:, self.prompt_length :]
        banned = torch.isneginf(self.rule(summary, torch.zeros_like(scores)))  # type: ignore[arg-type]
        if self.pieces is not None:
            glues = (banned & self.pieces.mask("starts", scores)).any(dim=-1, keepdim=True)
            banned = banned | (glues & self.pieces.mask("continues", scores))
        return scores.masked_fill(banned, -float("inf"))


def summary_processors(settings: SummarizeConfig, prompt_length: int,
                       loaded: LoadedModel | None = None) -> LogitsProcessorList:
    """The processors kvbatch adds to generate()'s own for a prompt of `prompt_length` tokens of
    `loaded`'s (whose tokenizer's word pieces the ban reads; None: the bare rule)."""
    size = settings.no_repeat_summary_ngram
    if not size:
        return LogitsProcessorList()
    pieces = loaded.word_pieces if loaded is not None else None
    return LogitsProcessorList([SummaryNoRepeatNGramLogitsProcessor(size, prompt_length, pieces)])
