"""The job folder: where job.json, manifest.parquet, events/, results/ and job.log live (docs/design.md).

job.json and manifest.parquet are written once, atomically, at creation; a resume needs nothing else, so
the original manifest and config files may be gone by then.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.schema import MANIFEST_SCHEMA
from storage.location import Location, Where
from storage.parts import list_parts, write_part


class JobDirError(RuntimeError):
    """A job folder that is missing or damaged; the message says what is wrong and how to recover."""


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    created: float
    version: str
    config: dict[str, Any]
    manifest_path: str
    manifest_sha256: str


@dataclass(frozen=True)
class JobDir:
    """A job folder: a local path or a storage URI (s3://, gs://, file://)."""

    path: Location

    def __init__(self, where: Where) -> None:
        try:
            object.__setattr__(self, "path", Location.of(where))
        except ValueError as e:
            raise JobDirError(f"job folder {e}: give a local path or an s3:// or file:// URI") from None

    @property
    def job_json(self) -> Location:
        return self.path / "job.json"

    @property
    def manifest(self) -> Location:
        return self.path / "manifest.parquet"

    @property
    def events(self) -> Location:
        return self.path / "events"

    @property
    def results(self) -> Location:
        return self.path / "results"

    @property
    def log(self) -> Location:
        return self.path / "job.log"

    @property
    def lock(self) -> Location:
        return self.path / ".lock"


#: Names that only a kvbatch job folder holds together: a created job, or one whose creation stopped early.
_JOB_MARKS = ({"job.json", "manifest.parquet"}, {"events", "results"})


def holds_job(names: set[str]) -> bool:
    """Whether a folder whose entries (files and folders) have these names is a kvbatch job folder."""
    return any(mark <= names for mark in _JOB_MARKS)


#: Where a job folder goes when submit is given no -j: runs/<job-id>, under the working directory.
DEFAULT_JOBS_DIR = Path("runs")


def new_job_id() -> str:
    """Sortable by creation time, unique across machines."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _write_json(target: Location, payload: dict[str, Any]) -> None:
    target.write_bytes_atomic(json.dumps(payload, indent=2).encode())


def _file_in_the_way(job: JobDir) -> Path | None:
    """The file a local job folder path names, or lies under; None when there is none."""
    if not job.path.is_local:
        return None
    path = job.path.local_path
    existing = next((p for p in (path, *path.parents) if os.path.exists(p)), None)
    return existing if existing is not None and not os.path.isdir(existing) else None


#: What a submit stopped before its manifest was published leaves: a folder holding only these may take a job.
_CREATION_NAMES = {".lock", "events", "results"}


def _entry_names(job: JobDir) -> set[str]:
    """Names of what the job folder holds (files and folders, hidden ones too); none if it is missing."""
    if job.path.is_local:
        try:
            return set(os.listdir(job.path.local_path))
        except (FileNotFoundError, NotADirectoryError):
            return set()
        except OSError as e:
            raise JobDirError(
                f"cannot read the job folder {job.path} ({e.strerror or e}): choose another -j JOB_DIR"
            ) from None
    return {f.name for f in job.path.files()} | set(job.path.folders())


def check_new_job_folder(job: JobDir) -> None:
    """Refuse, before anything is read or written, a path that is a file, holds a job, or is a non-empty
    folder that is no job folder (kvbatch removes files in its job folder: never in someone's other folder)."""
    if (blocking := _file_in_the_way(job)) is not None:
        raise JobDirError(f"{blocking} is a file, not a folder: give -j the path of a new job folder")
    if job.job_json.exists():
        raise JobDirError(
            f"{job.path} already holds a job ({job.job_json}); "
            f"continue it with `kvbatch resume {job.path}` or choose another -j JOB_DIR"
        )
    names = _entry_names(job)
    if names and not holds_job(names) and not names <= _CREATION_NAMES:
        shown = ", ".join(f"{name}/" if (job.path / name).is_dir() else name for name in sorted(names)[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise JobDirError(
            f"{job.path} is not empty and is not a kvbatch job folder (it holds {shown}{more}): "
            "give -j a new or empty folder, or leave -j out to make runs/<job-id>"
        )


def make_job_folder(job: JobDir) -> None:
    """The folder a new job is created in, or a one-line JobDirError naming it (no permission, a file in the way)."""
    try:
        job.path.makedirs()
    except OSError as e:
        raise JobDirError(
            f"cannot create the job folder {job.path} ({e.strerror or e}): choose another -j JOB_DIR"
        ) from None


def create_job(job: JobDir, info: JobInfo, manifest_table: pa.Table, rejected: pa.Table,
               copies: dict[str, bytes] | None = None) -> None:
    """Create the job's files; call with the job lock held. Refuses a folder that holds (part of) a job.

    `copies` (the manifest made from a folder) are written only once the folder is known to hold no job, so a
    refused submit changes nothing; job.json is published last, so a crash at any instant loses no row.
    """
    check_new_job_folder(job)
    leftovers = [f.name for f in (job.manifest,) if f.exists()] + [
        f"{folder.name}/" for folder in (job.results, job.events) if list_parts(folder)
    ]
    if leftovers:
        raise JobDirError(
            f"{job.path} holds part of a job that was never fully created, or one whose job.json is lost "
            f"({', '.join(leftovers)} but no job.json): export what it holds with `kvbatch results {job.path}` "
            "if you need it, then remove the folder or choose another -j JOB_DIR"
        )
    for folder in (job.path, job.events, job.results):
        folder.makedirs()
    for name, data in (copies or {}).items():
        (job.path / name).write_bytes_atomic(data)
    if rejected.num_rows:
        write_part(job.results, rejected)
    table = manifest_table.cast(MANIFEST_SCHEMA)
    job.manifest.write_atomic(lambda handle: pq.write_table(table, handle))
    payload = {
        "job_id": info.job_id,
        "created": info.created,
        "kvbatch_version": info.version,
        "config": info.config,
        "manifest": {"path": info.manifest_path, "sha256": info.manifest_sha256},
    }
    _write_json(job.job_json, payload)


def read_job(job: JobDir) -> JobInfo:
    try:
        data = json.loads(job.job_json.read_bytes().decode("utf-8"))
        return JobInfo(
            job_id=data["job_id"],
            created=data["created"],
            version=data["kvbatch_version"],
            config=data["config"],
            manifest_path=data["manifest"]["path"],
            manifest_sha256=data["manifest"]["sha256"],
        )
    except (FileNotFoundError, NotADirectoryError):
        check_job_folder(job)  # neither job.json nor results/: not a job folder at all
        raise JobDirError(
            f"{job.job_json} is missing, so {job.path} cannot be resumed; its results/ are intact: "
            f"export them with `kvbatch results {job.path}` and submit the remaining documents as a new job"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise JobDirError(
            f"{job.job_json} is damaged ({type(e).__name__}: {e}); restore it from a backup, or export "
            f"what is done with `kvbatch results {job.path}` and submit the rest as a new job"
        ) from None


def check_job_folder(job: JobDir) -> None:
    """Raise JobDirError unless `job` holds a job: a job.json, or the results of one whose job.json is lost."""
    if job.job_json.exists() or list_parts(job.results):
        return
    if (blocking := _file_in_the_way(job)) is not None:
        raise JobDirError(f"{job.path} is not a job folder ({blocking} is a file): give the job's folder (the -j of submit)")
    if not job.path.is_dir():
        raise JobDirError(f"{job.path} is not a job folder (it does not exist): check the path")
    raise JobDirError(f"{job.path} is not a job folder (it has no job.json and no results/): check the path")


def update_job_config(job: JobDir, config: dict[str, Any]) -> None:
    """Record the config a resume runs with (after --set), so the next resume uses it too."""
    data = json.loads(job.job_json.read_bytes().decode("utf-8"))
    data["config"] = config
    _write_json(job.job_json, data)


def read_manifest_table(job: JobDir) -> pa.Table:
    try:
        with job.manifest.open_input() as source:
            return pq.read_table(source, schema=MANIFEST_SCHEMA)
    except FileNotFoundError:
        raise JobDirError(
            f"{job.manifest} is missing; without it the job's documents are unknown. Submit the "
            f"original manifest again as a new job (done documents can be exported from {job.results})"
        ) from None
    except (pa.ArrowInvalid, OSError) as e:
        raise JobDirError(
            f"{job.manifest} is unreadable ({e}); submit the original manifest again as a new job"
        ) from None
