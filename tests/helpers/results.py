"""Result rows as the coordinator writes them, for tests that fill a checkpoint log directly."""

from __future__ import annotations

from jobs.schema import RESULT_SCHEMA, TaskState, empty_row


def done_row(doc: str) -> dict:
    """A `done` result row of document `doc` (task id `t-<doc>`), every other column empty."""
    row = empty_row(RESULT_SCHEMA)
    row.update(doc_id=doc, task_id=f"t-{doc}", status=TaskState.DONE.value, summary=f"summary of {doc}", attempts=1)
    return row
