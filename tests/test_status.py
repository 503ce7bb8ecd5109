"""Watching a batch: `status` while it runs (from another process) and after, progress lines, live alerts.

One scenario, recorded once: a batch whose last document hangs (a real hang in the worker, from
KVBATCH_FAULTS) is watched with `kvbatch status`, interrupted, then resumed on a pseudo-terminal
(so the rich progress bar is drawn) and watched again when it has finished.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args, get_origin, get_type_hints, is_typeddict

import pytest

from runner.observe.joblog import read_log
from runner.observe.status import JobStatus, job_status
from storage.jobdir import JobDirError
from tests.helpers.cli import REPO, kvbatch, start_submit, wait_for, write_jsonl

SENTENCE = "The committee reviewed the quarterly figures and agreed to publish them next week. "
#: Same length class (1024-2047 chars); the hanging one is shortest, so it is taken last.
DOCS = {name: SENTENCE * 19 for name in ("a", "b", "c", "d")} | {"bsd": SENTENCE * 17}
DOCUMENTED_KEYS = {
    "job_id", "job_dir", "created", "coordinator", "total", "counts", "run_started", "run_elapsed_s",
    "throughput_docs_per_s", "tokens_per_s", "output_tokens", "eta_s", "strategies", "batch", "fallbacks", "running",
    "slowest", "alerts", "corrupt_parts", "as_of", "quantization", "stop_reasons",
}


def assert_shaped_like(value: dict, typed: type, where: str = "status") -> None:
    """`value` has `typed`'s keys in its order, and so has each nested TypedDict (lists of them too)."""
    hints = get_type_hints(typed)
    assert list(value) == list(hints), where
    for key, hint in hints.items():
        if is_typeddict(hint):
            assert_shaped_like(value[key], hint, f"{where}.{key}")
        elif get_origin(hint) is list and is_typeddict(get_args(hint)[0]):
            for i, item in enumerate(value[key]):
                assert_shaped_like(item, get_args(hint)[0], f"{where}.{key}[{i}]")


def status_json(job: Path) -> dict:
    return json.loads(kvbatch("status", str(job), "--json", check=0).stdout)


def status_now(job: Path) -> dict | None:
    try:
        return job_status(job)
    except JobDirError:  # the job folder is not written yet
        return None


def alerts_of(job: Path, kind: str) -> list[dict]:
    return [e for e in read_log(job / "job.log") if e["event"] == "alert" and e["kind"] == kind]


def run_on_a_terminal(args: list[str], timeout: float = 300) -> tuple[int, str]:
    """Runs the CLI with a pseudo-terminal as stdout/stderr; returns its exit code and everything it drew."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
    proc = subprocess.Popen([sys.executable, "-m", "runner", *args], stdin=slave, stdout=slave, stderr=slave,
                            cwd=REPO, env=env)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return code, out.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def watched(ray_address, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("status")
    manifest = write_jsonl(tmp / "manifest.jsonl", [{"id": k, "text": v} for k, v in DOCS.items()])
    job = tmp / "job"
    env = {
        "KVBATCH_FAULTS": json.dumps([{"doc": "bsd", "fault": "hang"}]),
        "KVBATCH_PROGRESS_INTERVAL_S": "0.5",
        "KVBATCH_ALERT_MEMORY_FRACTION": "0.01",  # any machine is "full": the memory alert must fire
    }
    proc = start_submit(manifest, job, ray_address, "--set", "checkpoint.flush_every=1", env=env)
    seen: dict = {}
    try:
        def bsd_alone_running() -> bool:
            s = status_now(job)
            return bool(s and s["counts"]["done"] == 4 and s["counts"]["running"] == 1)

        assert wait_for(bsd_alone_running, proc, timeout=240, poll=0.2), proc.communicate()
        seen["running_json"] = status_json(job)
        seen["running_text"] = kvbatch("status", str(job), check=0).stdout
        bsd_slow = lambda: any(a["doc_id"] == "bsd" for a in alerts_of(job, "slow_task"))  # noqa: E731
        assert wait_for(bsd_slow, proc, timeout=60, poll=0.2)
        proc.send_signal(signal.SIGINT)
        seen["submit_out"], seen["submit_err"] = proc.communicate(timeout=120)
        seen["submit_code"] = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen["stopped_json"] = status_json(job)
    seen["resume_code"], seen["resume_screen"] = run_on_a_terminal(["resume", str(job), "--address", ray_address])
    seen["finished_json"] = status_json(job)
    seen["finished_text"] = kvbatch("status", str(job), check=0).stdout
    seen["job"] = job
    return seen


def test_status_of_a_running_job_from_another_process(watched):
    s = watched["running_json"]
    assert s.keys() == DOCUMENTED_KEYS
    assert s["coordinator"] and s["coordinator"].startswith("pid ")
    assert s["counts"] == {"pending": 0, "running": 1, "done": 4, "failed": 0, "rejected": 0}
    [running] = s["running"]
    assert running["doc_id"] == "bsd" and running["attempt"] == 1 and running["since_s"] >= 0
    assert s["throughput_docs_per_s"] > 0 and s["tokens_per_s"] > 0
    assert s["eta_s"] is not None and s["eta_s"] > 0  # one document left, at this run's pace
    assert sum(s["strategies"].values()) == 4
    assert [r["doc_id"] for r in s["slowest"]] and "bsd" not in [r["doc_id"] for r in s["slowest"]]
    text = watched["running_text"]
    assert "running (pid" in text and "done 4, running 1, pending 0" in text
    assert re.search(r"│ bsd\s+│ 1 ", text), text


def test_live_alerts_reach_job_log_and_console(watched):
    job = watched["job"]
    [slow] = [a for a in alerts_of(job, "slow_task") if a["doc_id"] == "bsd"]  # others may be slow too
    assert slow["doc_id"] == "bsd" and slow["level"] == "warning"
    assert slow["seconds"] > 2 * slow["median_s"] and slow["length_class"] == "1024-2047 chars"
    [memory] = alerts_of(job, "memory")  # once, however many times it was seen over the threshold
    assert memory["resource"] == "host RAM" and memory["used_fraction"] > 0.01
    out = watched["submit_out"]
    assert "alert (slow_task): task " in out and "(bsd) running for" in out
    assert "alert (memory): host RAM" in out


def test_plain_progress_lines_when_stdout_is_not_a_terminal(watched):
    assert watched["submit_code"] == 130, watched["submit_err"]
    lines = [line for line in watched["submit_out"].splitlines() if line.startswith("progress: ")]
    assert len(lines) >= 2, watched["submit_out"]  # periodic, not only at the end
    assert lines[-1].startswith("progress: 4/5 documents  elapsed ")
    # busy workers out of the 2, however many tasks each runs
    assert all(re.search(r" [\d.]+ tok/s  ETA \S+  failed 0  active [0-2]/2 workers  fallbacks 0$", line)
               for line in lines), lines
    assert "\x1b[" not in watched["submit_out"]  # no terminal control codes in a log file


def _runs_progress(job: Path) -> list[list[dict]]:
    """job.log's `progress` lines of each run (a run begins at its `batch_start`)."""
    runs: list[list[dict]] = []
    for event in read_log(job / "job.log"):
        if event["event"] == "batch_start":
            runs.append([])
        elif event["event"] == "progress" and runs:
            runs[-1].append(event)
    return runs


def test_status_and_the_progress_bar_count_elapsed_from_the_same_start(watched):
    """Both count this run from when its documents began to run (its workers ready): status from the run's
    `batch_start`, before its workers started, said more than the bar beside it."""
    first, resumed = _runs_progress(watched["job"])
    for status, samples in ((watched["running_json"], first), (watched["finished_json"], resumed)):
        assert samples, "the run logged no progress"
        bar_started = [p["ts"] - p["elapsed_s"] for p in samples]
        assert max(abs(status["run_started"] - started) for started in bar_started) < 0.25, (status, samples)


def test_status_after_an_interruption(watched):
    s = watched["stopped_json"]
    assert s["coordinator"] is None
    assert s["counts"] == {"pending": 1, "running": 0, "done": 4, "failed": 0, "rejected": 0}
    assert s["running"] == [] and s["eta_s"] is None  # nothing is running, so no ETA
    assert s["alerts"]["by_kind"]["slow_task"] >= 1 and s["alerts"]["by_kind"]["memory"] == 1


def test_rich_progress_bar_on_a_terminal(watched):
    assert watched["resume_code"] == 0, watched["resume_screen"]
    screen = watched["resume_screen"]
    assert "━" in screen and "5/5 documents" in screen
    assert "active" in screen and "tok/s" in screen
    assert "progress: " not in screen  # the bar replaces the plain lines


def test_status_of_a_finished_job(watched):
    s = watched["finished_json"]
    assert s.keys() == DOCUMENTED_KEYS
    assert s["coordinator"] is None and s["running"] == []
    assert s["counts"] == {"pending": 0, "running": 0, "done": 5, "failed": 0, "rejected": 0}
    assert s["eta_s"] == 0.0 and s["total"] == 5
    assert s["throughput_docs_per_s"] > 0  # the resumed run's: one document
    assert len(s["slowest"]) == 5 and s["slowest"][0]["wall_s"] >= s["slowest"][-1]["wall_s"]
    assert s["fallbacks"] == {"tasks": 0, "total": 0, "by_kind": {}}
    assert s["alerts"]["total"] >= 2 and s["alerts"]["recent"][-1]["message"]
    assert "not running" in watched["finished_text"] and "slowest documents" in watched["finished_text"]


def test_status_json_has_the_shape_of_job_status_typed_dict(watched):
    """`status --json` prints a JobStatus, in its key order, nested keys included (what scripts read)."""
    assert watched["running_json"]["running"] and watched["finished_json"]["alerts"]["recent"]  # lists to check
    for name in ("running_json", "stopped_json", "finished_json"):
        assert_shaped_like(watched[name], JobStatus, name)


def test_docs_document_every_status_json_key():
    page = (REPO / "docs" / "status.md").read_text(encoding="utf-8")
    section = page.split("## `kvbatch status JOB_DIR --json`", 1)[1].split("\n## ", 1)[0]
    missing = [key for key in DOCUMENTED_KEYS if f"`{key}`" not in section]
    assert not missing, f"docs/status.md's 'kvbatch status JOB_DIR --json' does not document {missing}"
