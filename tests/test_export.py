"""`kvbatch results` of ragged metadata (mixed types, integers past 2^63) in JSONL, CSV and Parquet:
every value kept as given or as text, metadata never overwrites a result column, a missing job folder
is an error; rows come in the manifest's order, with readable timestamps."""

from __future__ import annotations

import csv
import time
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, refusal, write_jsonl

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
    proc = refusal("results", str(tmp_path / "no" / "such" / "job"), "-o", str(tmp_path / "x.jsonl"))
    message = " ".join(proc.stderr.split())
    assert f"{tmp_path / 'no' / 'such' / 'job'} is not a job folder" in message and "Traceback" not in message
    assert not (tmp_path / "x.jsonl").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is not a job folder" in refusal("results", str(empty)).stderr


def test_results_come_in_manifest_order_with_readable_timestamps(ray_address, tmp_path: Path) -> None:
    """results/ holds rows as they were written: the rejected middle row first (at submit), then the
    summaries as they finished. The export lists them as the manifest did."""
    rows = [{"id": "first", "text": "The board met on Monday and approved the budget for next year."},
            {"id": "second"},  # neither text nor path: rejected
            {"id": "third", "text": "Two engineers join the team in March to work on the parser."}]
    job = tmp_path / "job"
    before = time.time()
    kvbatch("submit", str(write_jsonl(tmp_path / "m.jsonl", rows)), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, check=3)  # 3: a row was rejected
    written = pq.read_table(job / "results").column("doc_id").to_pylist()
    assert written[0] == "second", written  # the order the export must not keep
    exported = export_rows(job)
    assert [r["doc_id"] for r in exported] == ["first", "second", "third"]
    for row in exported:
        finished = datetime.fromisoformat(row["finished_at"])
        assert finished.tzinfo is not None and before - 1 <= finished.timestamp() <= time.time() + 1, row["finished_at"]
    kvbatch("results", str(job), "-o", str(tmp_path / "r.csv"), check=0)
    with (tmp_path / "r.csv").open(newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [r["doc_id"] for r in table] == ["first", "second", "third"]
    assert [r["finished_at"] for r in table] == [r["finished_at"] for r in exported]


@pytest.mark.parametrize("name", ["out.xlsx", "out.jsonl.gz", "out.txt"])
def test_an_output_extension_that_names_no_format_is_refused(ragged_job: Path, tmp_path: Path, name: str) -> None:
    """`-o out.xlsx` wrote JSON lines into out.xlsx; a .gz got no compression."""
    out = tmp_path / name
    proc = refusal("results", str(ragged_job), "-o", str(out))
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    message = " ".join(proc.stderr.split())
    assert str(out) in message and "jsonl, csv and parquet" in message and "--format" in message
    assert not out.exists()


def test_an_explicit_format_writes_under_any_name(ragged_job: Path, tmp_path: Path) -> None:
    kvbatch("results", str(ragged_job), "-o", str(tmp_path / "out.xlsx"), "--format", "csv", check=0)
    with (tmp_path / "out.xlsx").open(newline="", encoding="utf-8") as f:
        assert sorted(r["doc_id"] for r in csv.DictReader(f)) == ["a", "b", "c"]


@pytest.mark.parametrize(("name", "format_"), [("r.JSONL", "jsonl"), ("r.ndjson", "jsonl"), ("r.json", "jsonl"),
                                               ("r.CSV", "csv"), ("r.Parquet", "parquet"), ("results", "jsonl")])
def test_the_extension_chooses_the_format_in_any_case_and_none_is_json_lines(name: str, format_: str) -> None:
    from storage.export import format_for

    assert format_for(Path(name), None) == format_
    assert format_for(Path(name), "parquet") == "parquet"
