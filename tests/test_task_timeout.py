"""retry.task_timeout_s runs from when a task's first sequence begins to run in its worker, not from
when the call was sent: a task queued behind its batch-mates in a full worker is not killed as hung,
while a task that really hangs still times out. Real CLI, real Ray worker, real fault injection."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, write_jsonl

#: six passes' time on a loaded machine: a pass slowed by the files running beside it does not time out,
#: while the last of TOPICS waits 47 passes in its worker, past the timeout even where a pass takes a
#: quarter of a second (a quiet machine: 16 tasks there all finished within 4.3 s, short of the moment)
TIMEOUT_S = 6
NEW_TOKENS = 160  # a quarter of a second to a second a pass on the tiny model here, alone
TOPICS = [f"topic-{i:02d}" for i in range(48)]
# the tiny model's KV is 1 KiB a token: one pass (prompt + new tokens) fits, two do not, so the
# worker's admission runs its tasks one at a time while all of them are in flight (they queue)
ONE_AT_A_TIME = ["--set", "workers.count=1", "--set", f"batch.max_sequences={len(TOPICS)}",
                 "--set", "cache.strategy=dynamic",
                 "--set", "cache.device_kv_budget_bytes=420000", "--set", f"summarize.max_new_tokens={NEW_TOKENS}",
                 "--set", "summarize.min_context_tokens=1024",  # a merge pass fits (runner/preflight.py)
                 "--set", f"summarize.generation.min_new_tokens={NEW_TOKENS}",
                 "--set", f"retry.task_timeout_s={TIMEOUT_S}"]


def _manifest(tmp_path: Path, ids: list[str]) -> Path:
    return write_jsonl(tmp_path / "m.jsonl", [{"id": i, "text": f"The council met about the {i} and agreed."}
                                              for i in ids])


def test_a_task_queued_behind_its_batch_mates_is_not_killed_as_hung(tmp_path: Path, ray_address: str) -> None:
    job = tmp_path / "job"
    kvbatch("submit", str(_manifest(tmp_path, TOPICS)), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, *ONE_AT_A_TIME, check=0)
    rows = export_rows(job)
    assert [r["status"] for r in rows] == ["done"] * len(TOPICS)
    assert all(r["attempts"] == 1 and not r["fallbacks"] for r in rows), rows  # nobody timed out and retried
    assert all(r["batch_size"] == 1.0 and r["output_tokens"] == NEW_TOKENS for r in rows)  # one at a time
    # the moment under test: calls that waited in the worker longer than the timeout, and finished
    assert max(r["wall_s"] for r in rows) > TIMEOUT_S


def test_a_task_that_hangs_once_it_runs_still_times_out(tmp_path: Path, ray_address: str) -> None:
    job = tmp_path / "job"
    faults = [{"doc": "topic-01", "fault": "hang"}]
    kvbatch("submit", str(_manifest(tmp_path, ["topic-00", "topic-01"])), "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, *ONE_AT_A_TIME, "--set", "retry.max_attempts=2",
            "--set", "summarize.min_context_tokens=1024",  # no shorter context to fall back to
            env={"KVBATCH_FAULTS": json.dumps(faults)}, check=3, timeout=120)
    rows = {r["doc_id"]: r for r in export_rows(job)}
    assert rows["topic-01"]["status"] == "failed" and rows["topic-01"]["error_type"] == "TimeoutError", rows["topic-01"]
    assert f"retry.task_timeout_s={TIMEOUT_S}s" in rows["topic-01"]["error"]
    # a later attempt reads back the pass kept before the first hang, so no sequence of it ever runs:
    # its timeout still runs from when it began (a third one when the first loss was shared with topic-00)
    assert rows["topic-01"]["attempts"] >= 2, rows["topic-01"]
    assert rows["topic-00"]["status"] == "done"
