"""Chunk planning on real license texts, with simple regex tokenizers standing in for a fast tokenizer."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from jobs.chunking import (
    SUMMARY_SEPARATOR,
    Chunk,
    ContextTooSmallError,
    fewest_chunks,
    group_for_merge,
    plan_chunks,
    summary_budget,
)

LICENSES = {p.name: p.read_text(encoding="utf-8") for p in sorted(Path("/usr/share/common-licenses").iterdir()) if p.is_file()}

# Whitespace is not part of any token (like a word-level tokenizer).
WORDS = re.compile(r"\S+")
# Spaces glued to the next word and newlines as tokens of their own (like byte-level BPE).
BPE_LIKE = re.compile(r"\n+|[^\S\n]*[^\s]+|[^\S\n]+")

PARAGRAPH_GAP = re.compile(r"\n[^\S\n]*\n")
SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def spans_of(text: str, tokenizer: re.Pattern[str]) -> list[tuple[int, int]]:
    return [m.span() for m in tokenizer.finditer(text)]


def word_cut_levels(text: str, spans: list[tuple[int, int]]) -> tuple[set[int], set[int]]:
    """Independent oracle for WORDS tokens: indices i where a paragraph / sentence ends before token i."""
    paragraphs, sentences = set(), set()
    for i in range(1, len(spans)):
        gap = text[spans[i - 1][1] : spans[i][0]]
        if PARAGRAPH_GAP.search(gap):
            paragraphs.add(i)
        if SENTENCE_END.search(text[spans[i - 1][0] : spans[i - 1][1]]):
            sentences.add(i)
    return paragraphs, sentences


def check_invariants(text: str, spans: list[tuple[int, int]], chunks: list[Chunk], budget: int, overlap: int) -> None:
    n = len(spans)
    assert chunks[0].start_token == 0 and chunks[-1].end_token == n
    effective_overlap = min(overlap, budget // 4)
    if len(chunks) == 1:
        assert chunks[0].text == text  # a document that fits is summarised as given
    for chunk in chunks:
        assert 0 < chunk.end_token - chunk.start_token <= budget
        if len(chunks) > 1:
            assert chunk.text == text[spans[chunk.start_token][0] : spans[chunk.end_token - 1][1]]
    for previous, chunk in zip(chunks, chunks[1:]):
        # nothing dropped, and every chunk brings new tokens
        assert previous.start_token < chunk.start_token <= previous.end_token < chunk.end_token
        shared = previous.end_token - chunk.start_token
        assert effective_overlap <= shared <= 2 * effective_overlap


documents = st.builds(
    lambda name, start, length: LICENSES[name][start % len(LICENSES[name]) :][:length],
    st.sampled_from(sorted(LICENSES)),
    st.integers(0, 40_000),
    st.integers(200, 40_000),
)


@settings(max_examples=150, deadline=None)
@given(
    text=documents,
    tokenizer=st.sampled_from([WORDS, BPE_LIKE]),
    budget=st.integers(1, 400),
    overlap=st.integers(0, 100),
)
def test_chunks_fit_the_budget_cover_every_token_and_overlap(
    text: str, tokenizer: re.Pattern[str], budget: int, overlap: int
) -> None:
    spans = spans_of(text, tokenizer)
    if not spans:
        return
    chunks = plan_chunks(text, spans, budget, overlap)
    check_invariants(text, spans, chunks, budget, overlap)
    if len(spans) <= budget:
        assert chunks == [Chunk(0, len(spans), text)]
    assert plan_chunks(text, spans, budget, overlap) == chunks  # a plan is reproducible
    assert len(chunks) >= fewest_chunks(len(spans), budget, overlap)  # what a work estimate counts is the least


@settings(max_examples=40, deadline=None)
@given(n_tokens=st.integers(1, 12_000), budget=st.integers(4, 4000), overlap=st.integers(0, 64))
def test_a_text_that_may_break_at_every_word_takes_the_fewest_chunks(n_tokens: int, budget: int, overlap: int) -> None:
    text = "w " * n_tokens
    spans = [(2 * i, 2 * i + 1) for i in range(n_tokens)]  # one token per word
    assert len(plan_chunks(text, spans, budget, overlap)) == fewest_chunks(n_tokens, budget, overlap)


@settings(max_examples=150, deadline=None)
@given(text=documents, budget=st.integers(8, 400), overlap=st.integers(0, 100))
def test_chunks_end_and_start_at_paragraphs_then_sentences_when_there_is_one(
    text: str, budget: int, overlap: int
) -> None:
    spans = spans_of(text, WORDS)
    chunks = plan_chunks(text, spans, budget, overlap)
    paragraphs, sentences = word_cut_levels(text, spans)
    ov = min(overlap, budget // 4)
    previous_end = 0
    for index, chunk in enumerate(chunks[:-1]):
        # the end: the strongest boundary once the chunk is at least half full
        window = range(max(chunk.start_token + budget // 2, previous_end + 1), chunk.start_token + budget + 1)
        if paragraphs.intersection(window):
            assert chunk.end_token == max(paragraphs.intersection(window))
        elif sentences.intersection(window):
            assert chunk.end_token in sentences
        # the next start: the strongest boundary that keeps the overlap between ov and 2 * ov
        following = chunks[index + 1]
        if ov:
            start_window = range(max(chunk.start_token + 1, chunk.end_token - 2 * ov), chunk.end_token - ov + 1)
            if paragraphs.intersection(start_window):
                assert following.start_token == max(paragraphs.intersection(start_window))
            elif sentences.intersection(start_window):
                assert following.start_token in sentences
        previous_end = chunk.end_token


def test_a_whole_license_splits_mostly_at_paragraphs() -> None:
    text = LICENSES["GPL-3"]
    spans = spans_of(text, WORDS)
    chunks = plan_chunks(text, spans, budget_tokens=400, overlap_tokens=0)
    check_invariants(text, spans, chunks, 400, 0)
    paragraphs, _ = word_cut_levels(text, spans)
    at_paragraph = sum(c.end_token in paragraphs for c in chunks[:-1])
    assert at_paragraph == len(chunks) - 1
    assert "".join(c.text + "\n\n" for c in chunks).split() == text.split()  # no overlap: the words, once each


@pytest.fixture(scope="module")
def byte_level_bpe() -> Tokenizer:
    """A real fast tokenizer (byte-level BPE, as SmolLM2 uses) trained in a blink on the licenses."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(LICENSES.values(), trainer)
    return tokenizer


@pytest.mark.parametrize("budget", [300, 1000])
def test_real_bpe_offsets_give_chunks_ending_at_sentences_or_paragraphs(byte_level_bpe: Tokenizer, budget: int) -> None:
    cuts, clean_cuts = 0, 0
    for text in LICENSES.values():
        spans = byte_level_bpe.encode(text).offsets
        chunks = plan_chunks(text, spans, budget, overlap_tokens=32)
        check_invariants(text, spans, chunks, budget, 32)
        for chunk in chunks[:-1]:
            after = text[spans[chunk.end_token - 1][1] :]
            cuts += 1
            clean_cuts += bool(SENTENCE_END.search(chunk.text) or re.match(r"\s*\n[^\S\n]*\n", after))
    # the rest are sentences longer than half a chunk (the all-caps disclaimers), cut at a line break
    print(f"budget {budget}: {clean_cuts}/{cuts} cuts at a sentence or paragraph end")
    assert clean_cuts >= 0.9 * cuts


def test_worked_example_of_paragraph_and_sentence_cuts() -> None:
    text = (
        "Para one sentence one. Para one sentence two.\n\n"
        "Para two sentence one. Para two sentence two.\n\n"
        "Para three."
    )
    spans = spans_of(text, WORDS)
    assert len(spans) == 18
    no_overlap = plan_chunks(text, spans, budget_tokens=12, overlap_tokens=0)
    assert [(c.start_token, c.end_token) for c in no_overlap] == [(0, 8), (8, 18)]
    assert no_overlap[0].text == "Para one sentence one. Para one sentence two."
    assert no_overlap[1].text.startswith("Para two sentence one.") and no_overlap[1].text.endswith("Para three.")
    # with overlap, the next chunk restarts at the sentence before the cut
    overlapping = plan_chunks(text, spans, budget_tokens=12, overlap_tokens=2)
    assert [(c.start_token, c.end_token) for c in overlapping] == [(0, 8), (4, 16), (12, 18)]
    assert overlapping[1].text == "Para one sentence two.\n\nPara two sentence one. Para two sentence two."


def test_text_without_any_boundary_is_cut_between_tokens() -> None:
    text = "x" * 50
    spans = [(i, i + 1) for i in range(50)]  # one token per character, no whitespace anywhere
    chunks = plan_chunks(text, spans, budget_tokens=20, overlap_tokens=4)
    assert [(c.start_token, c.end_token) for c in chunks] == [(0, 20), (16, 36), (32, 50)]


def test_fitting_and_empty_texts_give_one_chunk() -> None:
    text = LICENSES["BSD"]
    spans = spans_of(text, WORDS)
    assert plan_chunks(text, spans, len(spans), 64) == [Chunk(0, len(spans), text)]
    assert plan_chunks("", [], 10, 2) == [Chunk(0, 0, "")]


def test_hostile_whitespace_is_planned_quickly() -> None:
    text = " " * 300_000 + "a" + "\n " * 150_000 + "b." + "\t" * 100_000 + "c"
    spans = spans_of(text, WORDS)
    started = time.monotonic()
    chunks = plan_chunks(text, spans, budget_tokens=2, overlap_tokens=0)
    assert time.monotonic() - started < 2
    assert [c.text for c in chunks] == ["a", "b." + "\t" * 100_000 + "c"]  # the blank lines win over "b."


@pytest.mark.parametrize(
    ("spans", "budget", "overlap", "message"),
    [
        ([(0, 3), (2, 1)], 5, 0, "token 1 has span \\(2, 1\\)"),
        ([(0, 3), (4, 99)], 5, 0, "token 1 has span \\(4, 99\\)"),
        ([(4, 5), (0, 3)], 5, 0, "token 1 has span \\(0, 3\\)"),
        ([(0, 3)], 0, 0, "budget_tokens must be positive"),
        ([(0, 3)], 5, -1, "overlap_tokens must not be negative"),
    ],
)
def test_bad_arguments_are_clear_errors(spans: list[tuple[int, int]], budget: int, overlap: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_chunks("abc def", spans, budget, overlap)


def test_summary_budget_is_what_is_left_after_prompt_and_answer() -> None:
    assert summary_budget(8192, 92, 200) == 7900
    with pytest.raises(ContextTooSmallError, match="context of 256 tokens .* prompt \\(100 tokens\\) .* max_new_tokens \\(156\\)"):
        summary_budget(256, 100, 156)


def test_group_for_merge_packs_neighbours_into_passes() -> None:
    assert group_for_merge([10] * 10, budget_tokens=35, separator_tokens=2) == [
        range(0, 3),
        range(3, 6),
        range(6, 9),
        range(9, 10),
    ]
    assert group_for_merge([40], budget_tokens=35, separator_tokens=2) == [range(0, 1)]
    assert group_for_merge([40, 5, 5, 40], budget_tokens=35, separator_tokens=2) == [
        range(0, 1),
        range(1, 3),
        range(3, 4),
    ]
    with pytest.raises(ContextTooSmallError, match="no two of the 3 partial summaries"):
        group_for_merge([30, 30, 30], budget_tokens=50, separator_tokens=1)


@given(
    counts=st.lists(st.integers(1, 60), min_size=1, max_size=40),
    budget=st.integers(1, 200),
    separator=st.integers(0, 3),
)
def test_merge_rounds_always_end_with_one_summary(counts: list[int], budget: int, separator: int) -> None:
    rounds = 0
    while len(counts) > 1:
        try:
            groups = group_for_merge(counts, budget, separator)
        except ContextTooSmallError:
            assert all(a + separator + b > budget for a, b in zip(counts, counts[1:]))
            return
        assert [i for g in groups for i in g] == list(range(len(counts)))
        for group in groups:
            if len(group) > 1:
                assert sum(counts[i] for i in group) + separator * (len(group) - 1) <= budget
        # a merged summary is at most as long as its longest input (as max_new_tokens guarantees)
        counts = [max(counts[i] for i in g) for g in groups]
        rounds += 1
    assert rounds <= 40


def test_summary_separator_is_a_paragraph_break() -> None:
    joined = SUMMARY_SEPARATOR.join(["First summary.", "Second summary."])
    spans = spans_of(joined, WORDS)
    chunks = plan_chunks(joined, spans, budget_tokens=3, overlap_tokens=0)
    assert [c.text for c in chunks] == ["First summary.", "Second summary."]
