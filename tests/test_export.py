"""Input users really have (scraped text, hand-edited CSV, ragged metadata) and the job-folder races
around `submit`: every row ends as a task or a named rejection, nothing crashes, nothing is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.config import InputConfig
from jobs.manifest import ManifestError, read_manifest, tasks_to_table
from tests.helpers.child_process import Child
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, write_jsonl

CFG = InputConfig()

#: A JSON-escaped lone surrogate, as scrapers emit when they cut a UTF-16 pair in half.
LONE = "\\ud800"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"id": "a", "text": "hi %s there"}', "'text'"),
        ('{"id": "a%s", "text": "hi"}', "'id'"),
        ('{"id": "a", "text": "hi", "prompt": "Sum %s up"}', "'prompt'"),
        ('{"id": "a", "text": "hi", "source": "web %s"}', "metadata 'source'"),
        ('{"id": "a", "text": "hi", "tags": {"k%s": [1]}}', "metadata 'tags'"),
        ('{"id": "a", "path": "doc%s.txt"}', "'path'"),
    ],
    ids=["text", "id", "prompt", "metadata", "nested-metadata-key", "path"],
)
def test_a_lone_surrogate_escape_is_a_rejected_row_naming_the_field(tmp_path: Path, line: str, field: str) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(line % LONE + "\n" + '{"id": "b", "text": "fine"}\n', encoding="utf-8")
    tasks, rejections = read_manifest(manifest, CFG)
    assert [t.doc_id for t in tasks] == ["b"]
    [rejection] = rejections
    assert rejection.reason.startswith("m.jsonl line 1")
    assert f"{field} contains a lone UTF-16 surrogate" in rejection.reason and "\\ud800" in rejection.reason
    # what is kept of the row (id, metadata) is valid UTF-8: it can be stored and exported
    json.dumps({"id": rejection.doc_id, "meta": rejection.meta}, ensure_ascii=False).encode("utf-8")
    tasks_to_table(tasks)


def test_csv_with_an_unterminated_quote_is_refused_naming_its_line(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text('id,text\na,"hello\nb,world\nc,more text\n', encoding="utf-8")
    with pytest.raises(ManifestError) as refused:
        read_manifest(manifest, CFG)
    message = str(refused.value)
    assert "m.csv line 2" in message and "quote" in message and "lines 2-4" in message


def test_csv_rows_swallowed_by_a_quote_that_closes_late_are_not_lost_silently(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text('id,text\na,"hello\nb,world\nc,"more" text\nd,last\n', encoding="utf-8")
    with pytest.raises(ManifestError, match="m.csv line 2"):
        read_manifest(manifest, CFG)


def test_a_bad_csv_row_on_one_line_stays_a_rejection_of_that_row(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text('id,text\na,"bad"quote\nb,"multi\nline"\nc,"last\n', encoding="utf-8")
    tasks, rejections = read_manifest(manifest, CFG)
    assert [t.doc_id for t in tasks] == ["b"]
    assert [(r.row, "line 2" in r.reason) for r in rejections] == [(2, True), (4, False)]
    assert "line 5" in rejections[1].reason  # the unterminated quote on the last line is named


# ---------------------------------------------------------------- `kvbatch results` of ragged metadata

BIG = 2**64 + 1  # above what a 64-bit integer holds


@pytest.fixture(scope="module")
def ragged_job(tmp_path_factory) -> Path:
    """A job whose rows' metadata differ in type from row to row; every row is rejected, so no Ray is needed."""
    tmp = tmp_path_factory.mktemp("ragged")
    rows = [
        {"id": "a", "team": "legal", "n": BIG, "status": "draft", "meta_status": "x", "score": 1},
        {"id": "b", "team": 5, "n": 3, "tags": ["q", 1], "score": 2.5},
        {"id": "c", "team": None, "flag": True},
    ]  # no text and no path: each row is rejected and exported with its metadata
    manifest = write_jsonl(tmp / "m.jsonl", rows)
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp / "job"), check=3)
    return tmp / "job"


def test_jsonl_export_keeps_every_metadata_value_as_given(ragged_job: Path) -> None:
    rows = {r["doc_id"]: r for r in export_rows(ragged_job)}
    assert [rows[d]["team"] for d in "abc"] == ["legal", 5, None]
    assert rows["a"]["n"] == BIG and rows["b"]["n"] == 3
    assert rows["b"]["tags"] == ["q", 1] and rows["c"]["flag"] is True
    # a metadata key never overwrites a result column, nor another metadata key
    assert {rows[d]["status"] for d in "abc"} == {"rejected"}
    assert rows["a"]["meta_status"] == "x" and rows["a"]["meta_meta_status"] == "draft"


def test_csv_and_parquet_exports_hold_ragged_metadata_as_text(ragged_job: Path, tmp_path: Path) -> None:
    import csv

    kvbatch("results", str(ragged_job), "-o", str(tmp_path / "r.csv"), check=0)
    with (tmp_path / "r.csv").open(newline="", encoding="utf-8") as f:
        by_id = {r["doc_id"]: r for r in csv.DictReader(f)}
    assert [by_id[d]["team"] for d in "abc"] == ["legal", "5", ""]
    assert by_id["a"]["n"] == str(BIG) and by_id["a"]["status"] == "rejected" and by_id["a"]["meta_meta_status"] == "draft"

    kvbatch("results", str(ragged_job), "-o", str(tmp_path / "r.parquet"), check=0)
    table = pq.read_table(tmp_path / "r.parquet")
    by_id = {r["doc_id"]: r for r in table.to_pylist()}
    assert [by_id[d]["team"] for d in "abc"] == ["legal", "5", None]
    assert by_id["a"]["n"] == str(BIG) and by_id["b"]["tags"] == '["q", 1]'
    assert [by_id[d]["score"] for d in "ab"] == [1.0, 2.5] and by_id["c"]["flag"] is True
    assert table.column_names.count("status") == 1


def test_results_of_a_missing_job_folder_is_an_error(tmp_path: Path) -> None:
    proc = kvbatch("results", str(tmp_path / "no" / "such" / "job"), "-o", str(tmp_path / "x.jsonl"), check=2)
    message = " ".join(proc.stderr.split())
    assert f"{tmp_path / 'no' / 'such' / 'job'} is not a job folder" in message and "Traceback" not in message
    assert not (tmp_path / "x.jsonl").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is not a job folder" in kvbatch("results", str(empty), check=2).stderr


# ---------------------------------------------------------------- creating a job folder, one writer at a time

#: Runs the real CLI in a child whose job-folder writes pause (forever) around job.json, so a test can
#: act at that exact moment; `when` is "before" or "after" the job.json write.
PAUSED_CLI = """
import sys, time
from storage.location import Location
real = Location.write_atomic
when = sys.argv[1]
def write_atomic(self, write, temp_name, *fence):
    if self.name == "job.json" and when == "before":
        print("pausing before job.json", flush=True)
        time.sleep(600)
    real(self, write, temp_name, *fence)
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
        second = kvbatch("submit", str(_rejected_only(tmp_path / "second.jsonl", ["b1"])), "-c", str(TINY_CONFIG),
                         "-j", str(job), check=2)
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
    second = kvbatch("submit", str(_rejected_only(tmp_path / "b.jsonl", ["b1"])), "-c", str(TINY_CONFIG),
                     "-j", str(job), check=2)
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
        refused = kvbatch("resume", str(job), "--set", "summarize.max_new_tokens=7", check=2)
        assert "in use by a running coordinator" in " ".join(refused.stderr.split())
        assert (job / "job.json").read_bytes() == before
    finally:
        holder.kill()
