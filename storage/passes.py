"""Finished passes of long documents (jobs/passes.py): `JOB_DIR/passes/<task_id>/part-*.parquet`.

Published by the coordinator as fenced parts (storage/parts.py) and removed once the document's result is
out (docs/cluster.md, "The job folder"). Only what kvbatch wrote is removed (part files and their
temporaries, in folders of tasks the manifest lists): the second line of defence after submit's refusal of a
non-empty folder that holds no job (storage/jobdir.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.passes import PassRow
from jobs.schema import PASS_SCHEMA
from storage.location import Fence, Location, Where, no_fence
from storage.parts import is_own_part_name, read_parts, write_part

PASSES_DIR = "passes"


def _task_folder(job_dir: Where, task_id: str) -> Location:
    return Location.of(job_dir) / PASSES_DIR / task_id


def write_passes(job_dir: Where, task_id: str, rows: list[PassRow], fence: Fence = no_fence) -> Location:
    """Publish finished passes of one task, in one part."""
    return write_part(_task_folder(job_dir, task_id), pa.Table.from_pylist(rows, schema=PASS_SCHEMA), fence=fence)


def read_passes(job_dir: Where, task_id: str) -> list[PassRow]:
    """The task's finished passes, one per key. A damaged part only costs its passes, which run again."""
    table, _ = read_parts(_task_folder(job_dir, task_id), PASS_SCHEMA)
    return list({row["key"]: row for row in table.to_pylist()}.values())


def _job_task_ids(job_dir: Where) -> set[str] | None:
    """The task ids of the job's manifest.parquet; None when there is none (no job was created there)."""
    manifest = Location.of(job_dir) / "manifest.parquet"
    try:
        with manifest.open_input() as source:
            return set(pq.read_table(source, columns=["task_id"]).column("task_id").to_pylist())
    except FileNotFoundError:
        return None
    except (pa.ArrowException, KeyError) as e:
        raise OSError(f"{manifest} is unreadable ({e})") from None


def tasks_with_passes(job_dir: Where) -> list[str]:
    """The job's task ids that have a passes folder; one named after no task of the job's manifest is not
    kvbatch's, neither listed nor emptied (a folder with no manifest, where no job runs, lists them all)."""
    folders = (Location.of(job_dir) / PASSES_DIR).folders()
    if not folders or (tasks := _job_task_ids(job_dir)) is None:
        return folders
    return [name for name in folders if name in tasks]


def remove_passes(job_dir: Where, task_ids: Iterable[str], fence: Fence = no_fence) -> None:
    """Remove each task's passes (and unfinished writes of them) once `fence` allows, and its folder
    once empty: only files named as kvbatch names a part go; anything else, and its folder, stays."""
    for task_id in task_ids:
        folder = _task_folder(job_dir, task_id)
        # its parts and any unfinished write of one, in one listing
        files = [f for f in folder.files() if is_own_part_name(f.name)]
        if files:
            fence()
        for part in files:
            part.delete()
        if folder.is_local:
            with suppress(OSError):  # gone already, or holds files that are not kvbatch's: left as it is
                folder.local_path.rmdir()
