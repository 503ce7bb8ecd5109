"""Finished passes of long documents: `JOB_DIR/passes/<task_id>/part-*.parquet`, one part a pass.

A document longer than its context is summarised in passes (its chunks, then merges of their
summaries). Each pass is published here the moment it ends, atomically like every part
(storage/parts.py), so a crash at any instant leaves each pass whole or absent. Any later attempt at
the document (a resume after a kill, a retry, another cache rung, a shorter context) reads the
folder back and reuses every pass whose key matches what it is about to run. A pass's key covers
everything that decides its tokens, so reusing one never changes a summary. The folder goes once
the document's result has been published; a crash in between leaves it for the next run's sweep.
Two workers sharing a long document's passes (batch.spread_passes) meet here too: each looks again
before it starts a pass, and skips one the other has kept; the document's own worker also leaves an
empty `started-<key>` marker as it starts a pass, which the helping worker leaves to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from jobs.schema import PASS_SCHEMA
from storage.location import Location, Where
from storage.parts import PART_PREFIX, PART_SUFFIX, read_parts, write_part

PASSES_DIR = "passes"
STARTED_PREFIX = "started-"


def _task_folder(job_dir: Where, task_id: str) -> Location:
    return Location.of(job_dir) / PASSES_DIR / task_id


def write_pass(job_dir: Where, row: dict[str, Any]) -> Location:
    """Publish one finished pass of task `row["task_id"]`."""
    return write_part(_task_folder(job_dir, row["task_id"]), pa.Table.from_pylist([row], schema=PASS_SCHEMA))


def read_passes(job_dir: Where, task_id: str) -> dict[str, dict[str, Any]]:
    """The task's finished passes by key. A damaged part only costs its pass, which runs again."""
    table, _ = read_parts(_task_folder(job_dir, task_id), PASS_SCHEMA)
    return {row["key"]: row for row in table.to_pylist()}


def pass_folder(job_dir: Where, task_id: str) -> tuple[frozenset[str], frozenset[str]]:
    """From one listing: the names of the task's parts (a cheap way to tell that another worker kept a
    pass since) and the keys of the passes marked started."""
    names = [f.name for f in _task_folder(job_dir, task_id).files()]
    return (frozenset(n for n in names if n.startswith(PART_PREFIX) and n.endswith(PART_SUFFIX)),
            frozenset(n.removeprefix(STARTED_PREFIX) for n in names if n.startswith(STARTED_PREFIX)))


def mark_started(job_dir: Where, task_id: str, key: str) -> None:
    """Say that pass `key` of the task has begun, so a helping worker leaves it to the one that began it."""
    (_task_folder(job_dir, task_id) / f"{STARTED_PREFIX}{key}").touch()


def tasks_with_passes(job_dir: Where) -> list[str]:
    """Task ids that have a passes folder."""
    return (Location.of(job_dir) / PASSES_DIR).folders()


def remove_passes(job_dir: Where, task_ids: Iterable[str]) -> None:
    """Remove each task's passes (and writes of them that never completed)."""
    for task_id in task_ids:
        folder = _task_folder(job_dir, task_id)
        for part in folder.files():  # its parts and any unfinished write of one, in one listing
            part.delete()
        if folder.is_local:
            try:
                folder.local_path.rmdir()
            except OSError:  # gone already, or a pass written since the listing: the next sweep takes it
                pass
