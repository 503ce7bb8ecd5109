"""`summarize.no_repeat_summary_ngram`: SummaryNoRepeatNGramLogitsProcessor bans a token that would
repeat an n-gram of the summary (the tokens after the prompt), never one of the prompt's or one that
spans the prompt's end, and its batched form (runner/engine/batched_logits.py) bans exactly what it
bans, row by row, whatever the rows' prompt lengths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from jobs.config import ConfigError, SummarizeConfig, config_from_dict
from runner.engine.batched_logits import NoRepeatNGrams, batched_form
from runner.engine.summary_ngrams import SummaryNoRepeatNGramLogitsProcessor, summary_processors

VOCAB = 12
PROMPT = [1, 2, 9, 4, 1]
SUMMARY = [2, 7, 1, 2, 3, 8, 1, 2]
"""The summary ends in (1, 2): it holds (1, 2, 3); the prompt holds (1, 2, 9); (1, 2, 7) spans both."""


def _banned(scores: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row == -float("inf")).flatten().tolist() for row in scores]


def test_a_summary_ngram_is_banned_and_a_prompt_ngram_is_not() -> None:
    ids = torch.tensor([PROMPT + SUMMARY])
    scores = torch.randn(1, VOCAB)
    ours = SummaryNoRepeatNGramLogitsProcessor(3, len(PROMPT))(ids, scores.clone())
    assert _banned(ours) == [[3]]
    assert torch.equal(ours[:, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]], scores[:, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]])
    # transformers' own rule over the whole sequence bans the prompt's and the spanning n-gram too
    assert _banned(NoRepeatNGramLogitsProcessor(3)(ids, scores.clone())) == [[3, 7, 9]]


def test_nothing_is_banned_before_the_summary_holds_an_ngram() -> None:
    """At the first new token the prompt's n-grams ending in (4, 1) would ban under the whole-sequence
    rule; the summary has none yet."""
    prompt = [4, 1, 5, 4, 1]
    scores = torch.randn(1, VOCAB)
    for summary in ([], [6], [6, 4]):
        ids = torch.tensor([prompt + summary])
        assert _banned(SummaryNoRepeatNGramLogitsProcessor(3, len(prompt))(ids, scores.clone())) == [[]]
    assert _banned(NoRepeatNGramLogitsProcessor(3)(torch.tensor([prompt]), scores.clone())) == [[5]]


def test_the_batched_form_starts_empty_and_bans_what_the_processor_bans() -> None:
    form = batched_form(SummaryNoRepeatNGramLogitsProcessor(3, len(PROMPT)), PROMPT)
    assert isinstance(form, NoRepeatNGrams) and form.tokens == []
    for token in SUMMARY:
        form.note(token)
    assert form.banned() == [3]


@given(st.lists(st.tuples(st.lists(st.integers(0, 4), max_size=12), st.lists(st.integers(0, 4), max_size=20)),
                min_size=1, max_size=5),
       st.integers(1, 4))
def test_rows_batched_are_banned_as_the_processor_bans_each_alone(rows: list[tuple[list[int], list[int]]],
                                                                  size: int) -> None:
    """Rows with their own prompts and summaries (a small vocabulary, so n-grams recur) in one
    `apply`: each row's scores are the processor's over that row alone, bit for bit."""
    scores = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(len(rows)))
    forms = []
    for prompt, summary in rows:
        form = batched_form(SummaryNoRepeatNGramLogitsProcessor(size, len(prompt)), prompt)
        for token in summary:
            form.note(token)
        forms.append(form)
    together = NoRepeatNGrams.apply(forms, scores)
    for row, (prompt, summary) in enumerate(rows):
        processor = SummaryNoRepeatNGramLogitsProcessor(size, len(prompt))
        alone = processor(torch.tensor([prompt + summary], dtype=torch.long), scores[row : row + 1].clone())
        assert torch.equal(together[row : row + 1], alone), f"row {row}: {prompt} + {summary}"


def test_the_setting_makes_the_processor_and_zero_turns_it_off() -> None:
    (processor,) = summary_processors(SummarizeConfig(no_repeat_summary_ngram=5), 40)
    assert (processor.ngram_size, processor.prompt_length) == (5, 40)
    assert SummarizeConfig().no_repeat_summary_ngram == 4
    assert len(summary_processors(SummarizeConfig(no_repeat_summary_ngram=0), 40)) == 0


def test_a_negative_size_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"summarize\.no_repeat_summary_ngram"):
        config_from_dict({"summarize": {"no_repeat_summary_ngram": -1}})
