"""Result rows as the coordinator writes them, for tests that fill a checkpoint log directly."""

from __future__ import annotations

from jobs.passes import PassRow
from jobs.schema import RESULT_SCHEMA, TaskState, empty_row


def done_row(doc: str) -> dict:
    """A `done` result row of document `doc` (task id `t-<doc>`), every other column empty."""
    row = empty_row(RESULT_SCHEMA)
    row.update(doc_id=doc, task_id=f"t-{doc}", status=TaskState.DONE.value, summary=f"summary of {doc}", attempts=1)
    return row


def kept_pass(task_id: str, key: str) -> PassRow:
    """A finished pass of task `task_id` whose key is `key`, as a worker hands it back."""
    return PassRow(task_id=task_id, doc_id=task_id, key=key, fingerprint="f", level=0, index=0, context_tokens=512,
                   prompt_tokens=3, tokens=[7], text="7", stop_reason="eos", worker="w", finished_at=0.0,
                   prefill_s=0.5, decode_s=1.0, batch_size=1.0)
