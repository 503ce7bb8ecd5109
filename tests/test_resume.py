"""Crash safety, retries and fallbacks, with real processes killed by real signals.

A real job serves several tests here (module fixtures, each test asserting its own part): one job is
SIGKILLed before any result, resumed, stopped by Ctrl-C and resumed to its end; one job's documents crash
their worker, run out of memory and fail at every size; one job hangs while a second coordinator is
refused. The number of workers is the point of none of them: every job runs one, the baseline too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from jobs.fallback import Fallback, FallbackKind
from jobs.faults import FAULTS_ENV
from tests.helpers.cli import (
    LICENSE_DOCS,
    REPO,
    TINY_CONFIG,
    done_summaries,
    export_rows,
    kvbatch,
    license_manifest,
    refusal,
    start_submit,
    wait_for,
)

ONE_WORKER = ["--set", "workers.count=1"]
FAST = ["--set", "checkpoint.flush_every=1", *ONE_WORKER]
#: one task at a time: a lost worker is then the lost task's alone, so each document's attempts are its own
ONE_AT_A_TIME = ["--set", "batch.max_sequences=1"]


def manifest_of(tmp_path: Path, names: list[str] = LICENSE_DOCS) -> Path:
    return license_manifest(tmp_path, names)


def visible_parts(job: Path, sub: str) -> list[Path]:
    d = job / sub
    return sorted(p for p in d.glob("part-*.parquet")) if d.exists() else []


def temp_files(job: Path) -> list[Path]:
    return [p for sub in ("results", "events") if (job / sub).exists() for p in (job / sub).iterdir()
            if not p.name.startswith("part-")]


def mid_write(job: Path) -> bool:
    """Mid-batch (two parts published) while another part is being written (its temporary file is there)."""
    return len(visible_parts(job, "results")) >= 2 and bool(temp_files(job))


def retried_after(job: Path, doc_id: str, error_type: str) -> bool:
    """Whether the job log shows `doc_id` retried after an `error_type`: that failure did happen."""
    events = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    return any(e["event"] == "task_retry" and e["doc_id"] == doc_id and e["error_type"] == error_type for e in events)


def start_resume(job: Path, address: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvbatch resume` (this environment with `env`), left running in the background."""
    return subprocess.Popen([sys.executable, "-m", "runner", "resume", str(job), "--address", address],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def baseline(ray_address, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("baseline")
    job = tmp / "job"
    kvbatch("submit", str(manifest_of(tmp)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            *ONE_WORKER, check=0)
    return done_summaries(job)


@dataclass
class Interrupted:
    job: Path
    killed_before_any_result: bool  # the submit was SIGKILLed once job.json existed and before any result
    parts_at_kill: int
    ctrl_c_mid_batch: bool  # the resume got SIGINT once a result was published, before it ended
    ctrl_c_code: int
    ctrl_c_out: str
    resumed: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def interrupted(ray_address, tmp_path_factory) -> Interrupted:
    """A submit SIGKILLed before any result, its resume stopped by Ctrl-C mid-batch, then resumed to its end."""
    tmp = tmp_path_factory.mktemp("interrupted")
    job = tmp / "job"
    proc = start_submit(manifest_of(tmp), job, ray_address, *FAST)
    reached = wait_for(lambda: (job / "job.json").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    parts_at_kill = len(visible_parts(job, "results"))
    # gpl-2 hangs once its chunks are kept: the batch cannot end between the first result and the Ctrl-C
    proc = start_resume(job, ray_address, env={FAULTS_ENV: json.dumps([{"doc": "gpl-2", "fault": "hang"}])})
    try:
        mid_batch = wait_for(lambda: len(visible_parts(job, "results")) > parts_at_kill, proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    resumed = kvbatch("resume", str(job), "--address", ray_address, check=0)
    return Interrupted(job, reached, parts_at_kill, mid_batch, proc.returncode, out, resumed)


def test_sigkill_then_resume_gives_every_document_exactly_once(interrupted, baseline):
    """The moment before any result; a kill mid-batch is the flush test's (it lands with parts published)."""
    assert interrupted.killed_before_any_result, "the batch finished before the before-any-result kill"
    assert interrupted.parts_at_kill == 0
    assert done_summaries(interrupted.job) == baseline, interrupted.resumed.stdout + interrupted.resumed.stderr


def test_ctrl_c_stops_cleanly_and_resume_finishes(interrupted, baseline):
    assert interrupted.ctrl_c_mid_batch, "the resume ended before a result was published"
    assert interrupted.ctrl_c_code == 130, interrupted.ctrl_c_out
    assert f"kvbatch resume {interrupted.job}" in interrupted.ctrl_c_out
    assert done_summaries(interrupted.job) == baseline


FLUSH_TRIES = 5


def test_sigkill_during_a_flush_then_resume_gives_every_document_exactly_once(baseline, ray_address, tmp_path):
    """The kill must land mid-batch (two parts published) while a part is being written: the proof is the
    half-written temporary file it leaves behind. A part write takes milliseconds, so a batch is tried
    again until one does."""
    for attempt in range(FLUSH_TRIES):
        job = tmp_path / f"job-{attempt}"
        proc = start_submit(manifest_of(tmp_path), job, ray_address, *FAST)
        wait_for(lambda job=job: mid_write(job), proc, poll=0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if mid_write(job):
            break
    else:
        pytest.fail(f"no SIGKILL out of {FLUSH_TRIES} landed during a part write")
    assert mid_write(job)  # the moment: mid-batch, a part half written
    resumed = kvbatch("resume", str(job), "--address", ray_address, check=0)
    assert done_summaries(job) == baseline, resumed.stdout + resumed.stderr
    assert not temp_files(job)  # the finished job's compaction removed the crashed writer's leftovers


@pytest.fixture(scope="module")
def failing(ray_address, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """bsd's worker crashes at its first attempt, apache-2.0 runs out of memory on every cache rung above
    512 tokens, cc0-1.0 fails with an I/O error at every attempt."""
    tmp = tmp_path_factory.mktemp("failing")
    faults = json.dumps([{"doc": "bsd", "fault": "crash", "attempts": [1]},
                         {"doc": "apache-2.0", "fault": "oom", "context_above": 512},
                         {"doc": "cc0-1.0", "fault": "io"}])
    job = tmp / "job"
    proc = kvbatch("submit", str(manifest_of(tmp, ["BSD", "Apache-2.0", "CC0-1.0"])), "-c", str(TINY_CONFIG),
                   "-j", str(job), "--address", ray_address, "--set", "retry.max_attempts=2", *ONE_WORKER,
                   *ONE_AT_A_TIME, env={"KVBATCH_FAULTS": faults}, check=3)
    return job, proc


def test_a_worker_process_that_dies_is_replaced_and_the_task_retried(failing):
    job, _ = failing
    rows = {r["doc_id"]: r for r in export_rows(job)}
    assert rows["bsd"]["status"] == "done" and rows["bsd"]["attempts"] == 2
    assert retried_after(job, "bsd", "WorkerDied")


def test_memory_failures_fall_back_to_a_shorter_context(failing):
    job, _ = failing
    [row] = [r for r in export_rows(job) if r["doc_id"] == "apache-2.0"]
    assert row["status"] == "done" and row["context_tokens"] == 512
    assert any(Fallback.parse(f).kind is FallbackKind.CACHE for f in row["fallbacks"])
    assert "context:1024->512 (OutOfMemoryError)" in row["fallbacks"]


def test_a_document_failing_at_every_size_ends_failed_with_exit_3(failing):
    job, proc = failing  # exit 3 checked by the fixture
    assert "failed" in proc.stdout
    [err] = export_rows(job, "--errors")
    assert err["doc_id"] == "cc0-1.0" and err["status"] == "failed" and err["error_type"] == "OSError"
    assert err["attempts"] == 2 * 3  # 2 attempts at each of 1024, 512, 256 tokens
    assert err["fallbacks"] == ["context:1024->512 (OSError)", "context:512->256 (OSError)"]
    assert {r["doc_id"] for r in export_rows(job)} == {"bsd", "apache-2.0", "cc0-1.0"}


@dataclass
class Hung:
    job: Path
    code: int
    output: str
    refused: subprocess.CompletedProcess  # a second coordinator's resume while the first ran
    coordinator_pid: int
    running_when_refused: bool


@pytest.fixture(scope="module")
def hung(ray_address, tmp_path_factory) -> Hung:
    """bsd hangs at its first attempt (an 8 s task timeout); while its coordinator runs, a second one
    (`kvbatch resume` in this process: refused before anything starts) tries the same job."""
    tmp = tmp_path_factory.mktemp("hung")
    faults = json.dumps([{"doc": "bsd", "fault": "hang", "attempts": [1]}])
    job = tmp / "job"
    proc = start_submit(manifest_of(tmp, ["BSD"]), job, ray_address, "--set", "retry.task_timeout_s=8",
                        env={"KVBATCH_FAULTS": faults})
    try:
        assert wait_for(lambda: (job / ".lock").exists() and (job / "job.json").exists(), proc, poll=0.05)
        refused = refusal("resume", str(job), "--address", ray_address)
        running = proc.poll() is None
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    return Hung(job, proc.returncode, out + err, refused, proc.pid, running)


def test_a_hung_task_times_out_and_is_retried(hung):
    assert hung.code == 0, hung.output
    [row] = export_rows(hung.job)
    assert row["status"] == "done" and row["attempts"] == 2
    assert retried_after(hung.job, "bsd", "TimeoutError")


def test_a_second_coordinator_on_the_same_job_refuses(hung):
    assert hung.running_when_refused, "the first coordinator ended before the second one tried"
    assert "in use by a running coordinator" in hung.refused.stderr and str(hung.coordinator_pid) in hung.refused.stderr


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
