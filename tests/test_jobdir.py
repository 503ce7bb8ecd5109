"""Damaged job folders: `status` and `resume` say what is wrong and how to recover, and never
overwrite good data."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.parts import CORRUPT_PART_ADVICE
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, license_manifest

DOCS = ["BSD", "Apache-2.0", "GPL-3"]
DAMAGED_NAME = "part-00000000000000000001-00000000-1-badbad.parquet"


@pytest.fixture(scope="module")
def finished_job(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("finished")
    job = base / "job"
    kvbatch("submit", str(license_manifest(base, DOCS)), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, check=0)
    return job


def _fingerprints(job: Path) -> dict[str, str]:
    """sha256 of every file a run must never rewrite (job.log and .lock are appended/held by design)."""
    return {
        str(p.relative_to(job)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(job.rglob("*")) if p.is_file() and p.name not in ("job.log", ".lock")
    }


def _no_traceback(proc) -> None:  # noqa: ANN001
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


def _zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


def _garbage(path: Path) -> None:
    path.write_bytes(b"PAR1" + bytes(range(256)) * 8)


def _wrong_schema(path: Path) -> None:
    pq.write_table(pa.table({"doc_id": ["x"], "colour": ["blue"]}), path)


@pytest.mark.parametrize(
    ("directory", "damage", "reason"),
    [
        ("results", _zero_bytes, "empty file (0 bytes)"),
        ("events", _garbage, "unreadable Parquet"),
        ("results", _wrong_schema, "wrong schema: missing column(s)"),
    ],
)
def test_a_damaged_part_is_named_skipped_and_left_alone(
    finished_job: Path, tmp_path: Path, directory: str, damage: Callable[[Path], None], reason: str
) -> None:
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    damaged = job / directory / DAMAGED_NAME
    damage(damaged)
    before = _fingerprints(job)

    status = kvbatch("status", str(job), check=0)
    resume = kvbatch("resume", str(job), check=0)  # every document is done: nothing runs, nothing is lost
    for proc in (status, resume):
        _no_traceback(proc)
        shown = " ".join((proc.stdout + proc.stderr).split())
        assert f"{damaged}: {reason}" in shown and CORRUPT_PART_ADVICE in shown
    assert "0 to run" in resume.stdout
    assert _fingerprints(job) == before  # good parts and the damaged one: byte for byte
    assert sorted(r["doc_id"] for r in export_rows(job)) == sorted(d.lower() for d in DOCS)


def test_resume_reruns_the_documents_of_a_damaged_results_part_and_keeps_it(
    finished_job: Path, tmp_path: Path, ray_address: str
) -> None:
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    (only_part,) = (job / "results").glob("part-*.parquet")
    _garbage(only_part)
    garbage = only_part.read_bytes()
    status = json.loads(kvbatch("status", str(job), "--json", check=0).stdout)
    assert status["counts"]["done"] == 0 and any(str(only_part) in p for p in status["corrupt_parts"])
    resume = kvbatch("resume", str(job), "--address", ray_address, check=0)
    _no_traceback(resume)
    assert "3 to run" in resume.stdout
    assert only_part.read_bytes() == garbage  # kept for the user to inspect, never rewritten
    rows = export_rows(job)
    assert sorted(r["doc_id"] for r in rows) == sorted(d.lower() for d in DOCS)
    assert {r["status"] for r in rows} == {"done"}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda job: (job / "job.json").unlink(), "job.json is missing, so {job} cannot be resumed"),
        (lambda job: (job / "job.json").write_text('{"job_id": '), "job.json is damaged (JSONDecodeError"),
        (lambda job: (job / "job.json").write_text('{"job_id": "x"}'), "job.json is damaged (KeyError"),
        (lambda job: (job / "manifest.parquet").unlink(), "manifest.parquet is missing"),
        (lambda job: _garbage(job / "manifest.parquet"), "manifest.parquet is unreadable"),
    ],
    ids=["no-job-json", "truncated-job-json", "incomplete-job-json", "no-manifest", "garbage-manifest"],
)
def test_missing_or_damaged_job_files_stop_status_and_resume_with_a_way_out(
    finished_job: Path, tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    damage(job)
    before = _fingerprints(job)
    for command in ("status", "resume"):
        proc = kvbatch(command, str(job), check=2)
        _no_traceback(proc)
        shown = " ".join(proc.stderr.split())
        assert message.format(job=job) in shown
        assert "as a new job" in shown  # how to recover
    assert _fingerprints(job) == before
    assert len(export_rows(job)) == len(DOCS)  # what is done can still be exported


def test_a_refused_second_submit_of_a_folder_changes_nothing_in_the_job(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "empty.txt").write_text("")  # rejected ("is empty"), so submit needs no Ray
    job = tmp_path / "job"
    _no_traceback(kvbatch("submit", str(docs), "-c", str(TINY_CONFIG), "-j", str(job)))
    kept = (job / "input-manifest.jsonl").read_text()
    assert "empty.txt" in kept
    before = {p: p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()}
    (docs / "later.txt").write_text("")  # the folder changed: a new listing would differ
    second = kvbatch("submit", str(docs), "-c", str(TINY_CONFIG), "-j", str(job), check=2)
    _no_traceback(second)
    assert f"{job} already holds a job" in " ".join(second.stderr.split())
    assert {p: p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()} == before
    assert (job / "input-manifest.jsonl").read_text() == kept
