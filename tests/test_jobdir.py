"""The job folder: creating one is one writer at a time (rejected rows land before job.json, a second
submit refuses and changes nothing, a crashed creation is refused, not mixed), and a damaged one makes
`status` and `resume` say what is wrong and how to recover, never overwriting good data."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.parts import CORRUPT_PART_ADVICE
from tests.helpers.child_process import Child
from tests.helpers.cli import (
    TINY_CONFIG,
    export_rows,
    job_fingerprints,
    kvbatch,
    license_manifest,
    refusal,
    write_jsonl,
)

#: short texts: what is in them is not the point, only that there are several
DOCS = ["BSD", "CC0-1.0", "LGPL-3"]


@pytest.fixture(scope="module")
def finished_job(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("finished")
    job = base / "job"
    kvbatch("submit", str(license_manifest(base, DOCS)), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, "--set", "workers.count=1", check=0)
    return job


def _no_traceback(proc) -> None:  # noqa: ANN001
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


def _zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


def _garbage(path: Path) -> None:
    path.write_bytes(b"PAR1" + bytes(range(256)) * 8)


def _wrong_schema(path: Path) -> None:
    pq.write_table(pa.table({"doc_id": ["x"], "colour": ["blue"]}), path)


#: (folder, damage, the reason shown): one job holds all three, and each is named on its own
DAMAGES = [
    ("results", _zero_bytes, "empty file (0 bytes)"),
    ("events", _garbage, "unreadable Parquet"),
    ("results", _wrong_schema, "wrong schema: missing column(s)"),
]


def test_damaged_parts_are_named_skipped_and_left_alone(finished_job: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    shown_for = {}
    for i, (directory, damage, reason) in enumerate(DAMAGES, 1):
        damaged = job / directory / f"part-{i:020d}-00000000-1-badbad.parquet"
        damage(damaged)
        shown_for[damaged] = reason
    before = job_fingerprints(job)

    status = kvbatch("status", str(job), check=0)
    resume = kvbatch("resume", str(job), check=0)  # every document is done: nothing runs, nothing is lost
    for proc in (status, resume):
        _no_traceback(proc)
        shown = " ".join((proc.stdout + proc.stderr).split())
        assert CORRUPT_PART_ADVICE in shown
        for damaged, reason in shown_for.items():
            assert f"{damaged}: {reason}" in shown
    assert "0 to run" in resume.stdout
    assert job_fingerprints(job) == before  # good parts and the damaged ones: byte for byte
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
    before = job_fingerprints(job)
    for command in ("status", "resume"):
        proc = refusal(command, str(job))
        _no_traceback(proc)
        shown = " ".join(proc.stderr.split())
        assert message.format(job=job) in shown
        assert "as a new job" in shown  # how to recover
    assert job_fingerprints(job) == before
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
    second = refusal("submit", str(docs), "-c", str(TINY_CONFIG), "-j", str(job))
    _no_traceback(second)
    assert f"{job} already holds a job" in " ".join(second.stderr.split())
    assert {p: p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()} == before
    assert (job / "input-manifest.jsonl").read_text() == kept


# ---------------------------------------------------------------- creating a job folder, one writer at a time

#: Runs the real CLI in a child whose job-folder writes pause (forever) around job.json, so a test can
#: act at that exact moment; `when` is "before" or "after" the job.json write.
PAUSED_CLI = """
import sys, time
from storage.location import Location
real = Location.write_atomic
when = sys.argv[1]
def write_atomic(self, write, *args):
    if self.name == "job.json" and when == "before":
        print("pausing before job.json", flush=True)
        time.sleep(600)
    real(self, write, *args)
    if self.name == "job.json" and when == "after":
        print("paused after job.json", flush=True)
        time.sleep(600)
Location.write_atomic = write_atomic
sys.argv = ["kvbatch", *sys.argv[2:]]
from runner.cli import main
main()
"""


def _reaches(child: Child, line: str) -> bool:
    """True once the child prints `line` (its other output, such as the job id, is skipped)."""
    while child.read_line() != line:
        pass
    return True


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _rejected_only(path: Path, ids: list[str]) -> Path:
    """Rows with neither text nor path: all rejected, so `submit` needs no Ray."""
    return write_jsonl(path, [{"id": i, "lang": "en"} for i in ids])


def test_rejected_rows_are_in_the_job_folder_by_the_time_job_json_is(tmp_path: Path) -> None:
    job = tmp_path / "job"
    manifest = _rejected_only(tmp_path / "m.jsonl", ["r1", "r2"])
    child = Child(PAUSED_CLI, "after", "submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job))
    try:
        assert _reaches(child, "paused after job.json")  # the moment is reached
    finally:
        child.kill()  # kill -9 right after job.json is published
    rows = export_rows(job, "--errors")
    assert sorted(r["doc_id"] for r in rows) == ["r1", "r2"]


def test_a_second_submit_to_a_job_folder_being_created_refuses_and_changes_nothing(tmp_path: Path) -> None:
    job = tmp_path / "job"
    first = _rejected_only(tmp_path / "first.jsonl", ["a1", "a2"])
    child = Child(PAUSED_CLI, "before", "submit", str(first), "-c", str(TINY_CONFIG), "-j", str(job))
    try:
        assert _reaches(child, "pausing before job.json")  # the first submit is mid-creation
        before = _files(job)
        second = refusal("submit", str(_rejected_only(tmp_path / "second.jsonl", ["b1"])), "-c", str(TINY_CONFIG),
                         "-j", str(job))
        message = " ".join(second.stderr.split())
        assert f"job folder {job} is in use" in message and str(child.pid) in message, second.stderr
        assert "Traceback" not in second.stderr
        assert _files(job) == before
    finally:
        child.kill()


def test_a_second_submit_after_a_crashed_creation_refuses_instead_of_mixing_jobs(tmp_path: Path) -> None:
    job = tmp_path / "job"
    child = Child(PAUSED_CLI, "before", "submit", str(_rejected_only(tmp_path / "a.jsonl", ["a1"])),
                  "-c", str(TINY_CONFIG), "-j", str(job))
    try:
        assert _reaches(child, "pausing before job.json")
    finally:
        child.kill()
    second = refusal("submit", str(_rejected_only(tmp_path / "b.jsonl", ["b1"])), "-c", str(TINY_CONFIG),
                     "-j", str(job))
    assert "never fully created" in " ".join(second.stderr.split()), second.stderr
    assert [r["doc_id"] for r in export_rows(job, "--errors")] == ["a1"]  # the first one's rows are intact


HOLD_LOCK = """
import sys, time
from storage.lease import job_lock
with job_lock(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_resume_with_set_leaves_job_json_alone_while_another_coordinator_holds_the_job(tmp_path: Path) -> None:
    job = tmp_path / "job"
    kvbatch("submit", str(_rejected_only(tmp_path / "m.jsonl", ["r1"])), "-c", str(TINY_CONFIG), "-j", str(job),
            check=3)
    before = (job / "job.json").read_bytes()
    holder = Child(HOLD_LOCK, str(job / ".lock"))
    try:
        assert holder.read_line() == "holding"
        refused = refusal("resume", str(job), "--set", "summarize.max_new_tokens=7")
        assert "in use by a running coordinator" in " ".join(refused.stderr.split())
        assert (job / "job.json").read_bytes() == before
    finally:
        holder.kill()


def test_a_job_folder_of_an_earlier_kvbatch_resumes_without_its_retired_keys(finished_job: Path, tmp_path: Path) -> None:
    """A job made while `batch.spread_passes` existed (issue 37 removed it) holds it in job.json: a
    resume drops it instead of refusing the user's job as an unknown key; a config naming it is refused."""
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    info = json.loads((job / "job.json").read_text(encoding="utf-8"))
    info["config"]["batch"]["spread_passes"] = True
    (job / "job.json").write_text(json.dumps(info), encoding="utf-8")
    proc = kvbatch("resume", str(job), check=0)
    assert "0 to run" in proc.stdout and "spread_passes" not in proc.stdout + proc.stderr
    refused = refusal("config", "--set", "batch.spread_passes=true")
    assert "unknown key" in refused.stdout + refused.stderr and "spread_passes" in refused.stdout + refused.stderr


# ---------------------------------------------------------------- a folder that is not kvbatch's

def test_a_folder_of_other_files_is_refused_as_a_job_folder_and_left_as_it_was(tmp_path: Path) -> None:
    """kvbatch removes files in its job folder (a document's passes): a folder that is not empty and holds no
    job was someone's, even one whose files sit where a job's would (passes/<task>/)."""
    folder = tmp_path / "mine"
    for relative in ("passes/holiday/photo.jpg", "passes/t000001/draft.txt"):
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(relative)
    before = _files(folder)
    proc = refusal("submit", str(_rejected_only(tmp_path / "m.jsonl", ["a"])), "-c", str(TINY_CONFIG),
                   "-j", str(folder))
    _no_traceback(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    message = " ".join(proc.stderr.split())
    assert f"{folder} is not empty and is not a kvbatch job folder" in message and "passes/" in message
    assert "give -j a new or empty folder" in message
    assert _files(folder) == before and sorted(p.name for p in folder.iterdir()) == ["passes"]


def test_an_empty_folder_and_one_a_stopped_submit_left_take_a_new_job(tmp_path: Path) -> None:
    """Empty, or holding only what a submit that stopped before its manifest leaves (the lock, events/,
    results/): a job is created there."""
    empty, stopped = tmp_path / "empty", tmp_path / "stopped"
    empty.mkdir()
    for name in ("events", "results"):
        (stopped / name).mkdir(parents=True)
    (stopped / ".lock").write_text("")
    for folder in (empty, stopped):
        kvbatch("submit", str(_rejected_only(tmp_path / "m.jsonl", ["a"])), "-c", str(TINY_CONFIG), "-j", str(folder),
                check=3)
        assert (folder / "job.json").is_file()
        assert [r["doc_id"] for r in export_rows(folder, "--errors")] == ["a"]
