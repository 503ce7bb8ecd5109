"""`summarize.no_repeat_summary_ngram`: SummaryNoRepeatNGramLogitsProcessor bans a token that would
repeat an n-gram of the summary (the tokens after the prompt), never one of the prompt's or one that
spans the prompt's end; a banned word start bans the tokens that would glue on to the word before it
(runner/engine/word_pieces.py); and its batched form (runner/engine/batched_logits.py) bans exactly
what it bans, row by row, whatever the rows' prompt lengths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from jobs.config import ConfigError, SummarizeConfig, config_from_dict
from runner.engine.batched_logits import NoRepeatNGrams, batched_form
from runner.engine.model_registry import word_tokenizer
from runner.engine.summary_ngrams import SummaryNoRepeatNGramLogitsProcessor, summary_processors
from runner.engine.word_pieces import WordPieces

VOCAB = 12
PROMPT = [1, 2, 9, 4, 1]
SUMMARY = [2, 7, 1, 2, 3, 8, 1, 2]
"""The summary ends in (1, 2): it holds (1, 2, 3); the prompt holds (1, 2, 9); (1, 2, 7) spans both."""
TEXTS = ["<s>", " a", " b", " c", "c", "d", ",", "e", " f", "\n", "", "g"]
"""Each id's text after a letter: 3 begins a word, 4, 5, 7 and 11 would glue on, 6, 9 and 10 neither."""
CONTINUES = [4, 5, 7, 11]


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


def test_a_banned_word_start_bans_the_tokens_that_would_glue_on_to_the_word_before_it() -> None:
    """(1, 2) was followed by 3, a new word: 1, 2 end a word, so besides 3 every token that would carry
    that word on is banned (the model's way round the ban was "under" + "which"); the other scores stay."""
    ids = torch.tensor([PROMPT + SUMMARY])
    scores = torch.randn(1, VOCAB)
    ours = SummaryNoRepeatNGramLogitsProcessor(3, len(PROMPT), WordPieces(TEXTS))(ids, scores.clone())
    assert _banned(ours) == [sorted([3, *CONTINUES])]
    kept = [t for t in range(VOCAB) if t not in (3, *CONTINUES)]
    assert torch.equal(ours[:, kept], scores[:, kept])


def test_a_banned_token_inside_a_word_bans_that_token_alone() -> None:
    """(8, 2) was followed by 4, which glues on: the word goes on there, so nothing more is banned."""
    summary = [8, 2, 4, 6, 8, 2]
    ids = torch.tensor([PROMPT + summary])
    ours = SummaryNoRepeatNGramLogitsProcessor(3, len(PROMPT), WordPieces(TEXTS))(ids, torch.randn(1, VOCAB))
    assert _banned(ours) == [[4]]


def test_word_pieces_read_from_real_tokenizers(tokenizer) -> None:
    """SmolLM2's byte-level BPE: " which" begins a word, "which" glues on, punctuation and special tokens
    do neither; a word-level vocabulary (the synthetic models') has only word starts."""
    pieces = WordPieces.of(tokenizer)
    scores = torch.zeros(1, len(tokenizer))
    starts, continues = pieces.mask("starts", scores), pieces.mask("continues", scores)
    (which,), (glued,), (comma,), (newline,) = (tokenizer.encode(t, add_special_tokens=False)
                                                for t in (" which", "which", ",", "\n"))
    assert starts[which] and not continues[which] and which in pieces.starts
    assert continues[glued] and not starts[glued]
    assert not starts[comma] and not continues[comma]
    assert starts[newline]
    assert not starts[tokenizer.eos_token_id] and not continues[tokenizer.eos_token_id]
    assert not (starts & continues).any() and continues.sum() > 10_000  # about a third of its vocabulary
    words = WordPieces.of(word_tokenizer(50))
    assert words.starts >= frozenset(range(3, 50))  # every word (its specials too read after a space)
    assert not words.mask("continues", torch.zeros(1, 64)).any()  # an lm head wider than the vocabulary


def test_the_batched_form_starts_empty_and_bans_what_the_processor_bans() -> None:
    form = batched_form(SummaryNoRepeatNGramLogitsProcessor(3, len(PROMPT)), PROMPT)
    assert isinstance(form, NoRepeatNGrams) and form.tokens == []
    for token in SUMMARY:
        form.note(token)
    assert form.banned() == [3]


@given(st.lists(st.tuples(st.lists(st.integers(0, 4), max_size=12), st.lists(st.integers(0, 4), max_size=20)),
                min_size=1, max_size=5),
       st.integers(1, 4),
       st.none() | st.lists(st.sampled_from([" w", "w", ",", ""]), min_size=VOCAB - 2, max_size=VOCAB + 2))
def test_rows_batched_are_banned_as_the_processor_bans_each_alone(rows: list[tuple[list[int], list[int]]],
                                                                  size: int, texts: list[str] | None) -> None:
    """Rows with their own prompts and summaries (a small vocabulary, so n-grams recur) in one
    `apply`, with or without word pieces (a tokenizer narrower or wider than the scores): each row's
    scores are the processor's over that row alone, bit for bit."""
    pieces = WordPieces(texts) if texts is not None else None
    scores = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(len(rows)))
    forms = []
    for prompt, summary in rows:
        form = batched_form(SummaryNoRepeatNGramLogitsProcessor(size, len(prompt), pieces), prompt)
        for token in summary:
            form.note(token)
        forms.append(form)
    together = NoRepeatNGrams.apply(forms, scores)
    for row, (prompt, summary) in enumerate(rows):
        processor = SummaryNoRepeatNGramLogitsProcessor(size, len(prompt), pieces)
        alone = processor(torch.tensor([prompt + summary], dtype=torch.long), scores[row : row + 1].clone())
        assert torch.equal(together[row : row + 1], alone), f"row {row}: {prompt} + {summary}"


@given(st.lists(st.integers(0, 4), max_size=24), st.integers(2, 5))
def test_the_bans_after_the_next_token_are_the_bans_once_it_is_noted(summary: list[int], size: int) -> None:
    """What a step whose input comes from the device applies (runner/engine/static_step.py): for every
    token x the next one could be, the ban listed for x is what the row bans after noting x (a run of
    one token, which makes the n-gram x completes the one looked up, included)."""
    form = NoRepeatNGrams(size, [])
    for token in summary:
        form.note(token)
    ahead = form.banned_after_next()
    assert ahead is not None
    for x in range(6):
        after = NoRepeatNGrams(size, [*summary, x])
        assert ahead.get(x, []) == after.banned(), f"after {summary} + [{x}]"


def test_a_run_of_one_token_bans_it_after_one_more() -> None:
    """[5, 5, 5] with 3-grams: after one more 5, (5, 5) -> 5 is the 3-gram that 5 itself completes."""
    form = NoRepeatNGrams(3, [5, 5])
    assert form.banned_after_next() == {5: [5]} and NoRepeatNGrams(3, [5, 5, 5]).banned() == [5]


def test_bans_after_the_next_token_of_unigrams_are_not_listed() -> None:
    assert NoRepeatNGrams(1, [3, 4]).banned_after_next() is None


def test_the_setting_makes_the_processor_and_zero_turns_it_off() -> None:
    (processor,) = summary_processors(SummarizeConfig(no_repeat_summary_ngram=5), 40)
    assert (processor.ngram_size, processor.prompt_length) == (5, 40)
    assert SummarizeConfig().no_repeat_summary_ngram == 4
    assert len(summary_processors(SummarizeConfig(no_repeat_summary_ngram=0), 40)) == 0


def test_a_negative_size_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"summarize\.no_repeat_summary_ngram"):
        config_from_dict({"summarize": {"no_repeat_summary_ngram": -1}})
