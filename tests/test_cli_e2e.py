"""End to end through the real CLI: manifest -> Ray workers with a real model -> Parquet results."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import LICENSES, TINY_CONFIG, export_rows, kvbatch, refusal, write_jsonl

#: a long text that must be map-reduced, and a short one that fits the context
DOCS = ["GPL-3", "BSD"]


@pytest.fixture(scope="module")
def finished_job(ray_address, tmp_path_factory):
    """One real batch on licence texts, with some rows that must be rejected (on one worker: how many
    run it is not the point here)."""
    tmp = tmp_path_factory.mktemp("e2e")
    (tmp / "empty.txt").write_text("")
    rows = [{"id": n.lower(), "path": str(LICENSES / n), "family": "licence"} for n in DOCS]
    rows += [
        {"id": "inline", "text": "Short inline note about a meeting on Thursday.", "max_new_tokens": 8},
        {"id": "missing", "path": "no-such-file.txt"},
        {"id": "empty", "path": "empty.txt"},
        {"id": "bsd", "text": "a duplicate id"},
    ]
    manifest = write_jsonl(tmp / "manifest.jsonl", rows)
    job = tmp / "job"
    proc = kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job),
                   "--address", ray_address, "--set", "workers.count=1", check=3)  # 3: rows were rejected
    return job, proc


def test_submit_summarises_every_valid_document(finished_job):
    job, proc = finished_job
    assert proc.stdout.splitlines()[0].startswith("job ")
    rows = {r["doc_id"]: r for r in export_rows(job) if r["status"] == "done"}  # a rejected duplicate id is "bsd" too
    done = set(rows)
    assert done == {"gpl-3", "bsd", "inline"}
    for doc in done:
        r = rows[doc]
        assert r["summary"] and r["output_tokens"] > 0 and r["attempts"] == 1
        assert r["cache_strategy"] and r["worker"] and r["ttft_s"] > 0 and r["wall_s"] > 0
    assert rows["gpl-3"]["family"] == "licence"  # metadata passes through
    assert rows["inline"]["output_tokens"] <= 8  # per-document override
    # GPL-3 (~8k tokens) does not fit the tiny config's 1024-token context: it is map-reduced
    assert rows["gpl-3"]["chunks"] > 1 and rows["bsd"]["chunks"] == 1


def test_bad_rows_are_rejected_with_reasons(finished_job):
    job, proc = finished_job
    errors = {r["task_id"]: r for r in export_rows(job, "--errors")}
    reasons = " | ".join(r["error"] for r in errors.values())
    assert len(errors) == 3, reasons
    assert all(r["status"] == "rejected" for r in errors.values())
    assert "no-such-file.txt" in reasons and "empty" in reasons and "duplicate" in reasons.lower()
    assert "rejected" in proc.stdout


def test_results_export_round_trips(finished_job, tmp_path):
    job, _ = finished_job
    jsonl_rows = export_rows(job)
    kvbatch("results", str(job), "-o", str(tmp_path / "r.parquet"), check=0)
    kvbatch("results", str(job), "-o", str(tmp_path / "r.csv"), check=0)
    parquet_rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    csv_rows = pacsv.read_csv(tmp_path / "r.csv").to_pylist()
    key = lambda r: r["task_id"]  # noqa: E731
    for row in parquet_rows:  # seconds since the epoch in Parquet, ISO 8601 text in JSON lines
        row["finished_at"] = datetime.fromtimestamp(row["finished_at"], timezone.utc).isoformat(timespec="milliseconds")
    assert sorted(parquet_rows, key=key) == sorted(jsonl_rows, key=key)
    assert sorted(r["summary"] or "" for r in csv_rows) == sorted(r["summary"] or "" for r in jsonl_rows)


def test_status_json_after_the_job(finished_job):
    job, _ = finished_job
    status = json.loads(kvbatch("status", str(job), "--json", check=0).stdout)
    assert status["counts"] == {"pending": 0, "running": 0, "done": 3, "failed": 0, "rejected": 3}
    assert status["total"] == 6 and status["eta_s"] == 0.0
    assert {"throughput_docs_per_s", "strategies", "fallbacks", "slowest"} <= status.keys()


def test_submit_refuses_a_bad_config_key_before_anything_runs(tmp_path):
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "hello"}])
    proc = refusal("submit", str(manifest), "-j", str(tmp_path / "job"), "--set", "cache.stratgy=dynamic")
    assert "cache.stratgy" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "job" / "results").exists()


def test_strict_refuses_a_manifest_with_rejected_rows(tmp_path):
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "hello"}, {"id": "b"}])
    proc = refusal("submit", str(manifest), "-j", str(tmp_path / "job"), "--strict")
    assert "row 2" in proc.stdout


def test_a_manifest_whose_every_row_is_rejected_says_so_and_exits_3(tmp_path):
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a"}, {"id": "b", "path": "missing.txt"}])
    job = tmp_path / "job"
    for command in (["submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job)], ["resume", str(job)]):
        proc = kvbatch(*command, check=3)
        assert "every document was rejected, none was summarised" in proc.stdout
        assert f"kvbatch results {job} --errors" in proc.stdout
    assert [r["status"] for r in export_rows(job, "--errors")] == ["rejected", "rejected"]


@pytest.mark.slow
def test_smollm2_writes_real_english_summaries(ray_address, tmp_path):
    manifest = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "bsd", "path": str(LICENSES / "BSD")},
        {"id": "memo", "text": "The board approved the new budget on Monday. Spending on research rises "
                               "by ten percent, and two new engineers will join the data team in March."},
    ])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest), "-j", str(job), "--address", ray_address,
            "--set", "summarize.max_new_tokens=48", "--set", "workers.count=1", check=0)
    rows = {r["doc_id"]: r for r in export_rows(job)}
    common = {"the", "a", "and", "of", "to", "is", "in", "for", "this", "that"}
    for doc in ("bsd", "memo"):
        words = rows[doc]["summary"].lower().replace(",", " ").replace(".", " ").split()
        assert len(words) >= 5 and len(common & set(words)) >= 2, rows[doc]["summary"]
    assert {"budget", "research", "engineers", "board"} & set(rows["memo"]["summary"].lower().split())
