"""A fallback: one move down a task's ladder, a cache rung or a shorter context, and why.

`fallbacks` and job.log hold these as `str(fallback)` notes ("cache:dynamic->tiered-disk (OutOfMemoryError)"),
so old job folders read the same; `Fallback.parse` is the one reader. The ends hold no whitespace,
parentheses or "->", so every note parses back to the value that wrote it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

#: What a cache move's `target` reads as when the ladder ran out (no rung may have this name).
EXHAUSTED = "exhausted"
_NOTE = re.compile(r"(?P<kind>\w+):(?P<source>[^\s()]+?)->(?P<target>[^\s()]+) \((?P<reason>.*)\)", re.DOTALL)
_END = re.compile(r"[^\s()]+")
_TOKENS = re.compile(r"[0-9]+")


class FallbackKind(StrEnum):
    CACHE = "cache"  # the next cache rung, at the same context size
    CONTEXT = "context"  # a shorter context, the ladder from its first rung again


@dataclass(frozen=True)
class Fallback:
    """One move; `source` and `target` are rung names (cache) or context sizes in tokens (context)."""

    kind: FallbackKind
    source: str  # the rung or context size that failed
    target: str | None  # where the task went on; None: the cache ladder ran out (cache moves only)
    reason: str  # the error type that caused the move

    def __post_init__(self) -> None:
        ends = [self.source] if self.target is None else [self.source, self.target]
        if not all(_END.fullmatch(end) and "->" not in end for end in ends):
            raise ValueError(f"a fallback's ends hold no whitespace, parentheses or '->': {ends}")
        if self.target == EXHAUSTED:
            raise ValueError(f"{EXHAUSTED!r} is how a fallback with target None reads; pass None")
        if self.kind == FallbackKind.CONTEXT and (self.target is None or not all(_TOKENS.fullmatch(e) for e in ends)):
            raise ValueError(f"a context fallback goes from one token count to another: {ends}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.source}->{self.target or EXHAUSTED} ({self.reason})"

    @classmethod
    def parse(cls, note: str) -> Fallback:
        """The fallback a note was written from; ValueError naming the note when it is not one."""
        m = _NOTE.fullmatch(note)
        if m is None:
            raise ValueError(f"not a fallback note: {note!r} (expected 'cache:RUNG->RUNG (REASON)' "
                             "or 'context:TOKENS->TOKENS (REASON)')")
        target = None if m["target"] == EXHAUSTED else m["target"]
        try:
            return cls(FallbackKind(m["kind"]), m["source"], target, m["reason"])
        except ValueError as e:  # an unknown kind, or ends no fallback has
            raise ValueError(f"not a fallback note: {note!r} ({e})") from None
