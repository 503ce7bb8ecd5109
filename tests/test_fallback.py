"""jobs/fallback.py: a fallback note reads back as the move that wrote it, and today's notes read as before.

Result rows store notes as strings, so the strings policy.py writes are pinned here verbatim: a job
folder written before `Fallback` existed must read the same.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.fallback import EXHAUSTED, Fallback, FallbackKind
from jobs.policy import cache_fallback_note, context_fallback_note
from jobs.rungs import RUNGS

#: A move's end: no whitespace or parentheses (a note's separators), never "->" or the exhausted word.
ends = st.text(st.characters(exclude_categories=("Z", "C"), exclude_characters="()"), min_size=1, max_size=12) \
    .filter(lambda end: "->" not in end and end != EXHAUSTED and end.split() == [end])
tokens = st.integers(min_value=0, max_value=10**7).map(str)
cache_moves = st.builds(Fallback, st.just(FallbackKind.CACHE), ends, st.none() | ends, st.text())
context_moves = st.builds(Fallback, st.just(FallbackKind.CONTEXT), tokens, tokens, st.text())


@settings(derandomize=True, max_examples=300, deadline=None)
@given(cache_moves | context_moves)
def test_a_note_parses_back_to_the_fallback_that_wrote_it(move: Fallback) -> None:
    assert Fallback.parse(str(move)) == move


@pytest.mark.parametrize("source", sorted(RUNGS))
def test_every_cache_note_the_ladder_writes_parses(source: str) -> None:
    for target in [*sorted(RUNGS.keys() - {source}), None]:
        note = cache_fallback_note(source, target, "OutOfMemoryError")
        assert note == f"cache:{source}->{target or 'exhausted'} (OutOfMemoryError)"
        assert Fallback.parse(note) == Fallback(FallbackKind.CACHE, source, target, "OutOfMemoryError")


@pytest.mark.parametrize(("note", "written", "move"), [
    (cache_fallback_note("dynamic", "tiered-disk", "OutOfMemoryError"), "cache:dynamic->tiered-disk (OutOfMemoryError)",
     Fallback(FallbackKind.CACHE, "dynamic", "tiered-disk", "OutOfMemoryError")),
    (cache_fallback_note("tiered-disk", None, "ScratchSpaceError"), "cache:tiered-disk->exhausted (ScratchSpaceError)",
     Fallback(FallbackKind.CACHE, "tiered-disk", None, "ScratchSpaceError")),
    (context_fallback_note(1024, 512, "OSError"), "context:1024->512 (OSError)",
     Fallback(FallbackKind.CONTEXT, "1024", "512", "OSError")),
])
def test_the_notes_policy_writes_read_as_they_always_have(note: str, written: str, move: Fallback) -> None:
    assert note == written
    assert Fallback.parse(note) == move


@pytest.mark.parametrize("note", [
    "cache:dynamic->tiered-disk",  # no reason
    "cache:dynamic (OutOfMemoryError)",  # no move
    "ladder:dynamic->static (OutOfMemoryError)",  # no such kind
    "context:1024->exhausted (OSError)",  # a context move always lands on a size
    "context:1024->half (OSError)",
    "dynamic->static (OutOfMemoryError)",
    "",
])
def test_a_string_that_is_no_note_is_refused_by_name(note: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"not a fallback note: {note!r}")):
        Fallback.parse(note)


@pytest.mark.parametrize(("source", "target"), [("dyn amic", "static"), ("dynamic", "a->b"), ("x(", "y"),
                                                ("dynamic", EXHAUSTED), ("", "static")])
def test_a_fallback_refuses_ends_its_note_could_not_read_back(source: str, target: str) -> None:
    with pytest.raises(ValueError):
        Fallback(FallbackKind.CACHE, source, target, "OutOfMemoryError")
