"""A summary cut by `max_new_tokens` ends at its last complete sentence (jobs/summaries.py), the cut words
kept apart; nothing is lost, and a summary with no sentence end stays whole."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs.summaries import last_sentence_end, trim_to_sentence


@pytest.mark.parametrize(("text", "summary", "tail"), [
    ("The licence grants rights. It also limits the warranty to", "The licence grants rights.",
     " It also limits the warranty to"),
    ("Is it free? Yes! Anyone may copy and", "Is it free? Yes!", " Anyone may copy and"),
    ('He said "stop." Then the text went on and', 'He said "stop."', " Then the text went on and"),
    ("The fee (see above.) 2 parties sign and", "The fee (see above.)", " 2 parties sign and"),
    ("Ends whole.", "Ends whole.", ""),
    ("Ends whole.\n", "Ends whole.", "\n"),
    ("许可证授予权利。它还限制", "许可证授予权利。", "它还限制"),
    ("他问：「可以吗？」然后", "他问：「可以吗？」", "然后"),
])
def test_the_summary_ends_at_its_last_complete_sentence(text: str, summary: str, tail: str) -> None:
    assert trim_to_sentence(text) == (summary, tail)


@pytest.mark.parametrize("text", [
    "Use any tool, e.g. a compiler or an editor, to build the",  # an abbreviation before a small letter
    "Version 3.5 of the licence and version 2.0 both say that",  # decimals
    "a summary with no sentence end at all",
    "",
])
def test_no_sentence_end_keeps_the_summary_whole(text: str) -> None:
    assert last_sentence_end(text) is None
    assert trim_to_sentence(text) == (text, "")


def test_an_abbreviation_is_no_end_but_the_sentence_before_it_is() -> None:
    assert trim_to_sentence("Tools exist. Use one, e.g. a compiler, to build the") == (
        "Tools exist.", " Use one, e.g. a compiler, to build the")


@given(st.text(alphabet=st.sampled_from(list("ab A1.!?\"')]。？ \n")), max_size=60) | st.text(max_size=60))
def test_summary_and_tail_add_up_to_the_text_and_the_summary_trims_to_itself(text: str) -> None:
    summary, tail = trim_to_sentence(text)
    assert summary + tail == text
    assert trim_to_sentence(summary) == (summary, "")  # it ends at a sentence end, or had none
    if tail:
        assert last_sentence_end(summary) == len(summary)
