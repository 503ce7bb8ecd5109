"""What to do after a failure, as plain functions: the coordinator and workers apply them.

The failure classes (input, setting, memory, transient) and what each leads to: docs/design.md, "Failures".
A setting error fails at once: the same settings fail again, and a shorter context changes none.
"""

from __future__ import annotations

from enum import StrEnum

from jobs.fallback import Fallback, FallbackKind


class FailureClass(StrEnum):
    INPUT = "input"
    SETTING = "setting"
    MEMORY = "memory"
    TRANSIENT = "transient"


def shorter_context(current: int, shrink: float, minimum: int) -> int | None:
    """The next context size to try, or None when it would fall below `minimum`."""
    return None if current <= minimum else max(int(current * shrink), minimum)


def cache_fallback_note(from_rung: str, to_rung: str | None, reason: str) -> str:
    """How a cache move reads in a result's `fallbacks` and in job.log (to_rung None: the ladder ran out)."""
    return str(Fallback(FallbackKind.CACHE, from_rung, to_rung, reason))


def context_fallback_note(from_tokens: int, to_tokens: int, reason: str) -> str:
    """How a move to a shorter context reads there."""
    return str(Fallback(FallbackKind.CONTEXT, str(from_tokens), str(to_tokens), reason))


#: Failures a retry or a shorter context cannot fix: the task ends with them at once.
FINAL_CLASSES = frozenset({FailureClass.INPUT, FailureClass.SETTING})
