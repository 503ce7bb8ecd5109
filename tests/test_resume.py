"""Crash safety, retries and fallbacks, with real processes killed by real signals."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from jobs.fallback import Fallback, FallbackKind
from tests.helpers.cli import (
    LICENSE_DOCS,
    TINY_CONFIG,
    done_summaries,
    export_rows,
    kvbatch,
    license_manifest,
    start_submit,
    wait_for,
)

FAST = ["--set", "checkpoint.flush_every=1"]


def manifest_of(tmp_path: Path, names: list[str] = LICENSE_DOCS) -> Path:
    return license_manifest(tmp_path, names)


def visible_parts(job: Path, sub: str) -> list[Path]:
    d = job / sub
    return sorted(p for p in d.glob("part-*.parquet")) if d.exists() else []


def temp_files(job: Path) -> list[Path]:
    return [p for sub in ("results", "events") if (job / sub).exists() for p in (job / sub).iterdir()
            if not p.name.startswith("part-")]


@pytest.fixture(scope="module")
def baseline(ray_address, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("baseline")
    job = tmp / "job"
    kvbatch("submit", str(manifest_of(tmp)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            check=0)
    return done_summaries(job)


@pytest.mark.parametrize("moment", ["before-any-result", "mid-batch"])
def test_sigkill_then_resume_gives_every_document_exactly_once(moment, baseline, ray_address, tmp_path):
    job = tmp_path / "job"
    proc = start_submit(manifest_of(tmp_path), job, ray_address, *FAST)
    conditions = {
        "before-any-result": lambda: (job / "job.json").exists(),
        "mid-batch": lambda: len(visible_parts(job, "results")) >= 2,
    }
    reached = wait_for(conditions[moment], proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached, f"the batch finished before the {moment} kill"
    done_before = len(visible_parts(job, "results"))
    assert moment != "before-any-result" or done_before == 0
    resumed = kvbatch("resume", str(job), "--address", ray_address, check=0)
    assert done_summaries(job) == baseline, resumed.stdout + resumed.stderr


FLUSH_TRIES = 5


def test_sigkill_during_a_flush_then_resume_gives_every_document_exactly_once(baseline, ray_address, tmp_path):
    """The kill must land while a part is being written: the proof is the half-written temporary
    file it leaves behind. A part write takes milliseconds, so a batch is tried again until one does."""
    for attempt in range(FLUSH_TRIES):
        job = tmp_path / f"job-{attempt}"
        proc = start_submit(manifest_of(tmp_path), job, ray_address, *FAST)
        wait_for(lambda: bool(visible_parts(job, "results")) and bool(temp_files(job)), proc, poll=0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if temp_files(job):
            break
    else:
        pytest.fail(f"no SIGKILL out of {FLUSH_TRIES} landed during a part write")
    assert visible_parts(job, "results") and temp_files(job)  # the moment: mid-batch, a part half written
    resumed = kvbatch("resume", str(job), "--address", ray_address, check=0)
    assert done_summaries(job) == baseline, resumed.stdout + resumed.stderr
    assert not temp_files(job)  # the finished job's compaction removed the crashed writer's leftovers


def test_a_worker_process_that_dies_is_replaced_and_the_task_retried(ray_address, tmp_path):
    faults = json.dumps([{"doc": "bsd", "fault": "crash", "attempts": [1]}])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest_of(tmp_path, ["BSD", "CC0-1.0"])), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, env={"KVBATCH_FAULTS": faults}, check=0)
    rows = {r["doc_id"]: r for r in export_rows(job)}
    assert rows["bsd"]["status"] == "done" and rows["bsd"]["attempts"] == 2
    log = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    assert any(e["event"] == "task_retry" and e["error_type"] == "WorkerDied" for e in log)


def test_a_hung_task_times_out_and_is_retried(ray_address, tmp_path):
    faults = json.dumps([{"doc": "bsd", "fault": "hang", "attempts": [1]}])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest_of(tmp_path, ["BSD"])), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, "--set", "retry.task_timeout_s=8", env={"KVBATCH_FAULTS": faults}, check=0)
    [row] = export_rows(job)
    assert row["status"] == "done" and row["attempts"] == 2


def test_memory_failures_fall_back_to_a_shorter_context(ray_address, tmp_path):
    # OOM on every cache rung while the context is above 512 tokens
    faults = json.dumps([{"doc": "apache-2.0", "fault": "oom", "context_above": 512}])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest_of(tmp_path, ["Apache-2.0"])), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, env={"KVBATCH_FAULTS": faults}, check=0)
    [row] = export_rows(job)
    assert row["status"] == "done" and row["context_tokens"] == 512
    assert any(Fallback.parse(f).kind is FallbackKind.CACHE for f in row["fallbacks"])
    assert "context:1024->512 (OutOfMemoryError)" in row["fallbacks"]


def test_a_document_failing_at_every_size_ends_failed_with_exit_3(ray_address, tmp_path):
    faults = json.dumps([{"doc": "bsd", "fault": "io"}])
    job = tmp_path / "job"
    proc = kvbatch("submit", str(manifest_of(tmp_path, ["BSD", "CC0-1.0"])), "-c", str(TINY_CONFIG),
                   "-j", str(job), "--address", ray_address, "--set", "retry.max_attempts=2",
                   env={"KVBATCH_FAULTS": faults}, check=3)
    assert "failed" in proc.stdout
    [err] = export_rows(job, "--errors")
    assert err["doc_id"] == "bsd" and err["status"] == "failed" and err["error_type"] == "OSError"
    assert err["attempts"] == 2 * 3  # 2 attempts at each of 1024, 512, 256 tokens
    assert err["fallbacks"] == ["context:1024->512 (OSError)", "context:512->256 (OSError)"]
    assert {r["doc_id"] for r in export_rows(job)} == {"bsd", "cc0-1.0"}


def test_a_second_coordinator_on_the_same_job_refuses(ray_address, tmp_path):
    faults = json.dumps([{"doc": "bsd", "fault": "hang"}])
    job = tmp_path / "job"
    proc = start_submit(manifest_of(tmp_path, ["BSD"]), job, ray_address, env={"KVBATCH_FAULTS": faults})
    try:
        assert wait_for(lambda: (job / ".lock").exists(), proc, poll=0.05)
        second = kvbatch("resume", str(job), "--address", ray_address, check=2)
        assert "in use by a running coordinator" in second.stderr and str(proc.pid) in second.stderr
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_stops_cleanly_and_resume_finishes(baseline, ray_address, tmp_path):
    job = tmp_path / "job"
    proc = start_submit(manifest_of(tmp_path), job, ray_address, *FAST)
    assert wait_for(lambda: len(visible_parts(job, "results")) >= 1, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert f"kvbatch resume {job}" in out
    kvbatch("resume", str(job), "--address", ray_address, check=0)
    assert done_summaries(job) == baseline


def test_done_summaries_fails_on_a_task_with_two_done_rows_the_export_would_hide(tmp_path):
    from jobs.schema import RESULT_SCHEMA, TaskState, empty_row
    from storage.checkpoint import CheckpointLog

    job = tmp_path / "job"
    with CheckpointLog(job, flush_every=1) as log:
        for summary in ("first", "second"):  # the same task finished twice
            row = empty_row(RESULT_SCHEMA)
            row.update(doc_id="a", task_id="t000001", status=TaskState.DONE.value, summary=summary, attempts=1)
            log.add_result(row)
    assert [r["summary"] for r in export_rows(job)] == ["first"]  # the export shows it once
    with pytest.raises(AssertionError, match="two done rows"):
        done_summaries(job)
