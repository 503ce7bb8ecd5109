"""Fault injection: make named documents fail on purpose to rehearse (and test) recovery.

Set `KVBATCH_FAULTS` to a JSON list of rules, e.g.
    [{"doc": "gpl-3", "fault": "oom", "attempts": [1, 2]},
     {"doc": "mit", "fault": "crash"},
     {"doc": "bsd", "fault": "oom", "rungs": ["dynamic"]},
     {"doc": "apache", "fault": "io", "context_above": 2048},
     {"doc": "*", "fault": "capture"}]
A rule fires when every condition it names holds: the document id (`*`: any), the document's attempt
(1-based: 1, and 1 more after each failed call of its), the cache rung in use, and the context size. It
strikes the pass whose summary is the document's (its only pass, or its last merge) once that pass has
run, before its row leaves the worker: the worker raises the real failure there (torch.OutOfMemoryError,
a real process exit, a real OSError, a real hang), so recovery runs through exactly the code paths a
real failure takes, and a crash loses that one pass. A `capture` rule is the
workers', not a task's: every CUDA-graph capture of the decode step fails (runner/engine/static_step.py
runs such steps eagerly).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

FAULTS_ENV = "KVBATCH_FAULTS"

FaultKind = Literal["oom", "crash", "io", "hang", "error", "capture"]


class FaultRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    doc: str
    fault: FaultKind
    attempts: list[int] | None = None
    rungs: list[str] | None = None
    context_above: int | None = None

    def matches(self, doc_id: str, attempt: int, rung: str, context_tokens: int) -> bool:
        return (
            self.fault != "capture"
            and self.doc in (doc_id, "*")
            and (self.attempts is None or attempt in self.attempts)
            and (self.rungs is None or rung in self.rungs)
            and (self.context_above is None or context_tokens > self.context_above)
        )


_RULES = TypeAdapter(list[FaultRule])


def parse_faults(text: str | None) -> list[FaultRule]:
    """Rules from the env var's JSON; a clear error names the variable when it is malformed."""
    if not text or not text.strip():
        return []
    try:
        return _RULES.validate_python(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as e:
        raise ValueError(f"{FAULTS_ENV} is not a valid list of fault rules: {e}") from None


def fault_for(
    rules: list[FaultRule], doc_id: str, attempt: int, rung: str, context_tokens: int
) -> FaultKind | None:
    """The fault of the first rule that matches this pass, if any."""
    return next((rule.fault for rule in rules if rule.matches(doc_id, attempt, rung, context_tokens)), None)
