"""Fault injection: make named documents fail on purpose to rehearse (and test) recovery.

`KVBATCH_FAULTS` is a JSON list of rules such as `{"doc": "gpl-3", "fault": "oom", "attempts": [1, 2]}`
(docs/cluster.md, "Rehearsing failures"). The worker raises the real failure (torch.OutOfMemoryError, a
process exit, an OSError, a hang), so recovery runs through exactly the code a real failure takes. A rule's
`attempts` are 1-based: 1, and 1 more after each failed call of the document.
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
