"""A non-transient error inside a task (a ConfigError, a TypeError or ValueError from a setting) fails
that task at once with its own message, without retries or context fallbacks; transient ones still
retry."""

from __future__ import annotations

import json
import time
from pathlib import Path

from runner.observe.joblog import read_log
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, write_jsonl


def _manifest(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short note about a meeting."},
                                              {"id": "b", "text": "Minutes of the second meeting."}])


def test_a_setting_that_fails_inside_every_task_fails_each_at_once(tmp_path: Path, ray_address: str) -> None:
    """suppress_tokens must be token ids; transformers takes "abc" at submit and raises ValueError
    when the batched decode builds its logits processor, inside each task. With the default hour-long
    task timeout the batch still ends within seconds, with that error: the engine survives it."""
    job = tmp_path / "job"
    started = time.monotonic()
    kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            "--set", "summarize.generation.suppress_tokens=abc", "--set", "workers.count=1",
            "--set", "retry.task_timeout_s=3600", timeout=300, check=3)
    assert time.monotonic() - started < 90
    rows = export_rows(job)
    assert sorted((r["doc_id"], r["status"], r["attempts"], r["fallbacks"], r["error_type"]) for r in rows) == [
        ("a", "failed", 1, [], "ValueError"), ("b", "failed", 1, [], "ValueError")]
    assert all("too many dimensions 'str'" in r["error"] for r in rows)  # its own message
    events = [e["event"] for e in read_log(job / "job.log")]
    assert "task_retry" not in events and "context_fallback" not in events, events


def test_an_io_error_inside_a_task_is_still_retried(tmp_path: Path, ray_address: str) -> None:
    job = tmp_path / "job"
    faults = json.dumps([{"doc": "a", "fault": "io", "attempts": [1]}])
    kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            "--set", "workers.count=1", env={"KVBATCH_FAULTS": faults}, timeout=300, check=0)
    attempts = {r["doc_id"]: (r["status"], r["attempts"]) for r in export_rows(job)}
    assert attempts == {"a": ("done", 2), "b": ("done", 1)}
