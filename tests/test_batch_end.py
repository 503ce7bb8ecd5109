"""A batch ends when its last task ends: a worker that task took down is not waited for (its restart
would load the model again for nothing)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runner.engine.model_registry import tiny_random_dir
from runner.observe.joblog import read_log
from tests.helpers.cli import export_rows, license_manifest, start_submit, wait_for


def _assigned(job: Path, doc_id: str) -> bool:
    return any(e["event"] == "task_assigned" and e["doc_id"] == doc_id for e in read_log(job / "job.log"))


def test_the_worker_the_last_task_took_down_is_not_waited_for(ray_address: str, tmp_path: Path) -> None:
    # one worker, one task at a time: gpl-2 (the longest, dealt first), then bsd, which crashes it.
    # While gpl-2 runs the model folder moves away, so a restart of the worker could not start: a
    # batch that waited for it would stop with that error instead of ending with bsd failed.
    model = shutil.copytree(tiny_random_dir(), tmp_path / "model")
    job = tmp_path / "job"
    faults = json.dumps([{"doc": "bsd", "fault": "crash"}])
    proc = start_submit(license_manifest(tmp_path, ["GPL-2", "BSD"]), job, ray_address,
                        "--set", f"model.name={model}", "--set", "workers.count=1", "--set", "batch.max_sequences=1",
                        "--set", "retry.max_attempts=1", "--set", "summarize.min_context_tokens=1024",
                        env={"KVBATCH_FAULTS": faults})
    assert wait_for(lambda: _assigned(job, "gpl-2"), proc), proc.communicate()
    model.rename(tmp_path / "moved")
    assert not _assigned(job, "bsd"), "bsd ran before the model folder moved: nothing was tested"
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 3, stdout + stderr  # some tasks failed; not 2 (a worker could not start)

    rows = {r["doc_id"]: r for r in export_rows(job)}
    assert rows["gpl-2"]["status"] == "done"
    assert rows["bsd"]["status"] == "failed" and rows["bsd"]["error_type"] == "WorkerDied", rows["bsd"]
    log = read_log(job / "job.log")
    assert "worker_restart_failed" not in [e["event"] for e in log] and log[-1]["event"] == "batch_end", log
