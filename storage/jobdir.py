"""The job folder: where job.json, manifest.parquet, events/, results/ and job.log live.

job.json and manifest.parquet are written once, atomically, when a job is created; everything a
resume needs comes from them, so the original manifest and config files may be gone by then.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.schema import MANIFEST_SCHEMA


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
    path: Path

    @property
    def job_json(self) -> Path:
        return self.path / "job.json"

    @property
    def manifest(self) -> Path:
        return self.path / "manifest.parquet"

    @property
    def events(self) -> Path:
        return self.path / "events"

    @property
    def results(self) -> Path:
        return self.path / "results"

    @property
    def log(self) -> Path:
        return self.path / "job.log"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"


def new_job_id() -> str:
    """Sortable by creation time, unique across machines."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_table(path: Path, table: pa.Table) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_job(job: JobDir, info: JobInfo, manifest_table: pa.Table) -> None:
    """Create the folder with its job.json and manifest.parquet; refuses a folder that holds a job."""
    if job.job_json.exists():
        raise JobDirError(
            f"{job.path} already holds a job ({job.job_json}); "
            f"continue it with `kvbatch resume {job.path}` or choose another -j JOB_DIR"
        )
    job.path.mkdir(parents=True, exist_ok=True)
    job.events.mkdir(exist_ok=True)
    job.results.mkdir(exist_ok=True)
    _atomic_write_table(job.manifest, manifest_table.cast(MANIFEST_SCHEMA))
    payload = {
        "job_id": info.job_id,
        "created": info.created,
        "kvbatch_version": info.version,
        "config": info.config,
        "manifest": {"path": info.manifest_path, "sha256": info.manifest_sha256},
    }
    _atomic_write_bytes(job.job_json, json.dumps(payload, indent=2).encode())


def read_job(job: JobDir) -> JobInfo:
    if not job.path.is_dir():
        raise JobDirError(f"{job.path} is not a job folder (it does not exist)")
    try:
        data = json.loads(job.job_json.read_text(encoding="utf-8"))
        return JobInfo(
            job_id=data["job_id"],
            created=data["created"],
            version=data["kvbatch_version"],
            config=data["config"],
            manifest_path=data["manifest"]["path"],
            manifest_sha256=data["manifest"]["sha256"],
        )
    except FileNotFoundError:
        raise JobDirError(
            f"{job.job_json} is missing, so {job.path} cannot be resumed; its results/ are intact: "
            f"export them with `kvbatch results {job.path}` and submit the remaining documents as a new job"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise JobDirError(
            f"{job.job_json} is damaged ({type(e).__name__}: {e}); restore it from a backup, or export "
            f"what is done with `kvbatch results {job.path}` and submit the rest as a new job"
        ) from None


def update_job_config(job: JobDir, config: dict[str, Any]) -> None:
    """Record the config a resume runs with (after --set), so the next resume uses it too."""
    data = json.loads(job.job_json.read_text(encoding="utf-8"))
    data["config"] = config
    _atomic_write_bytes(job.job_json, json.dumps(data, indent=2).encode())


def read_manifest_table(job: JobDir) -> pa.Table:
    try:
        return pq.read_table(job.manifest, schema=MANIFEST_SCHEMA)
    except FileNotFoundError:
        raise JobDirError(
            f"{job.manifest} is missing; without it the job's documents are unknown. Submit the "
            f"original manifest again as a new job (done documents can be exported from {job.results})"
        ) from None
    except (pa.ArrowInvalid, OSError) as e:
        raise JobDirError(
            f"{job.manifest} is unreadable ({e}); submit the original manifest again as a new job"
        ) from None
