"""A ban on repeated n-grams within the summary only (`summarize.no_repeat_summary_ngram`).

transformers' `no_repeat_ngram_size` reads the whole sequence, so on a decoder-only model it bans the
prompt's n-grams too: a summary could not quote four tokens of its document ("GNU Lesser General
General Public License"). This processor applies transformers' own rule to the new tokens alone.
generate() and the scheduler's `TokenPicker` both get it (runner/engine/generation.py), so a sequence
decoded alone and one decoded in a batch follow the same rule; its batched form is `NoRepeatNGrams`
with an empty table (runner/engine/batched_logits.py).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList, NoRepeatNGramLogitsProcessor

from jobs.config import SummarizeConfig


class SummaryNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Bans a token that would complete an `ngram_size`-gram already among the tokens after the first
    `prompt_length` (the summary so far); the prompt's n-grams stay allowed."""

    def __init__(self, ngram_size: int, prompt_length: int) -> None:
        self.rule = NoRepeatNGramLogitsProcessor(ngram_size)  # raises for a size that is not positive
        self.ngram_size = ngram_size
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return self.rule(input_ids[:, self.prompt_length :], scores)  # type: ignore[arg-type]


def summary_processors(settings: SummarizeConfig, prompt_length: int) -> LogitsProcessorList:
    """The processors kvbatch adds to generate()'s own for a prompt of `prompt_length` tokens."""
    size = settings.no_repeat_summary_ngram
    return LogitsProcessorList([SummaryNoRepeatNGramLogitsProcessor(size, prompt_length)] if size else [])
