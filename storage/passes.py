"""Finished passes of long documents: `JOB_DIR/passes/<task_id>/part-*.parquet`.

A document longer than its context is summarised in passes (its chunks, then merges of their
summaries). Workers hand each finished pass back to the coordinator, which alone writes the job
folder: it publishes them here, fenced by its lease and atomically like every part
(storage/parts.py), so a crash at any instant leaves each part whole or absent. Any later attempt at
the document (a resume after a kill, a retry, another cache rung, a shorter context) is handed the
passes read back from here and reuses every pass whose key matches what it is about to run. A pass's
key covers everything that decides its tokens, so reusing one never changes a summary. The folder
goes once the document's result has been published; a crash in between leaves it for the next run's
sweep.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

import pyarrow as pa

from jobs.schema import PASS_SCHEMA
from storage.location import Fence, Location, Where, no_fence
from storage.parts import read_parts, write_part

PASSES_DIR = "passes"


class PassRow(TypedDict):
    """One finished pass, as a worker hands it back and as it is kept (jobs.schema.PASS_SCHEMA)."""

    task_id: str
    doc_id: str
    key: str  # hash of the settings fingerprint, the prompt's token ids and the new-token limit
    fingerprint: str  # the model and the settings that decide a pass's tokens (runner/engine/pass_book.py)
    level: int  # 0: the chunks; then each merge round
    index: int  # its place among its level's passes
    context_tokens: int  # the context its plan was made for
    prompt_tokens: int
    tokens: list[int]  # what it generated
    text: str  # those tokens decoded
    stop_reason: str  # jobs.stopping.StopReason
    worker: str  # the "host:pid" that ran it
    finished_at: float
    prefill_s: float | None  # how long it took there (None: kept by an older tree), so a timeline can place it
    decode_s: float | None
    batch_size: float | None


def _task_folder(job_dir: Where, task_id: str) -> Location:
    return Location.of(job_dir) / PASSES_DIR / task_id


def write_passes(job_dir: Where, task_id: str, rows: list[PassRow], fence: Fence = no_fence) -> Location:
    """Publish finished passes of one task, in one part."""
    return write_part(_task_folder(job_dir, task_id), pa.Table.from_pylist(rows, schema=PASS_SCHEMA), fence=fence)


def read_passes(job_dir: Where, task_id: str) -> list[PassRow]:
    """The task's finished passes, one per key. A damaged part only costs its passes, which run again."""
    table, _ = read_parts(_task_folder(job_dir, task_id), PASS_SCHEMA)
    return list({row["key"]: row for row in table.to_pylist()}.values())


def tasks_with_passes(job_dir: Where) -> list[str]:
    """Task ids that have a passes folder."""
    return (Location.of(job_dir) / PASSES_DIR).folders()


def remove_passes(job_dir: Where, task_ids: Iterable[str], fence: Fence = no_fence) -> None:
    """Remove each task's passes (and writes of them that never completed); `fence` is checked first."""
    for task_id in task_ids:
        folder = _task_folder(job_dir, task_id)
        files = folder.files()  # its parts and any unfinished write of one, in one listing
        if files:
            fence()
        for part in files:
            part.delete()
        if folder.is_local:
            try:
                folder.local_path.rmdir()
            except OSError:  # gone already: nothing to do
                pass
