"""A summary stopped by `max_new_tokens` ends where its last complete sentence ends.

A reader is better served by the summary up to its last full stop than by one cut mid-sentence; the cut
words go to the result's `summary_tail`. What ends a sentence (kept simple on purpose: "Dr. Smith" is an
end): docs/summaries.md.
"""

from __future__ import annotations

import re

#: A mark that may end a sentence, with the closing quotes and brackets after it.
_WESTERN_END = re.compile(r"[.!?][\"'”’»)\]]*")
_CJK_END = re.compile(r"[。！？][」』”’）)】〕》\]]*")
#: What may open the next sentence: a capital letter (`str.isupper`), a digit, an opening quote or bracket.
_OPENERS = "\"'“‘«([¿¡"


def _opens_a_sentence(text: str, at: int) -> bool:
    """After a Western end mark: the end of the text, or whitespace then what may open a sentence."""
    if at == len(text):
        return True
    rest = text[at:]
    stripped = rest.lstrip()
    if len(stripped) == len(rest):  # no whitespace: "3.5", "e.g.,", "file.txt"
        return False
    return not stripped or stripped[0].isupper() or stripped[0].isdigit() or stripped[0] in _OPENERS


def last_sentence_end(text: str) -> int | None:
    """The index just past the last complete sentence of `text` (its end mark and closers), or None."""
    ends = [m.end() for m in _CJK_END.finditer(text)]
    ends += [m.end() for m in _WESTERN_END.finditer(text) if _opens_a_sentence(text, m.end())]
    return max(ends, default=None)


def trim_to_sentence(text: str) -> tuple[str, str]:
    """`(summary, tail)` with `summary + tail == text`: the summary ends at the last complete sentence and the
    tail holds what follows it; a text with no sentence end is kept whole (`tail` empty)."""
    end = last_sentence_end(text)
    return (text, "") if end is None else (text[:end], text[end:])
