"""The real kvbatch CLI in a subprocess, the manifests it reads and the results it exports."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LICENSES = Path("/usr/share/common-licenses")
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
#: eight licence texts of mixed lengths (1.5 to 27 KB): the documents of the end-to-end batches
LICENSE_DOCS = ["GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "Artistic", "BSD", "CC0-1.0", "LGPL-3"]


def kvbatch(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
            check: int | None = None, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Runs the real CLI in a subprocess (this environment with `env`, without `unset`); `check` asserts its
    exit code."""
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment,
    )
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def refusal(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI in this process for a command refused with exit 2 before anything starts: the same
    app, output and exit code as `kvbatch(..., check=2)` without a Python start-up that imports torch."""
    from typer.testing import CliRunner

    from runner.cli import app

    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 2, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def job_fingerprints(job: Path) -> dict[str, str]:
    """sha256 of every file in a job folder that a run must never rewrite (job.log and .lock are
    appended/held by design)."""
    return {
        str(p.relative_to(job)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(job.rglob("*")) if p.is_file() and p.name not in ("job.log", ".lock")
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def export_rows(job_dir: Path, *extra: str) -> list[dict]:
    proc = kvbatch("results", str(job_dir), *extra, check=0)
    return [json.loads(line) for line in proc.stdout.splitlines()]


def done_summaries(job: Path | str) -> dict[str, str]:
    """doc id -> summary of an exported job whose every document is done, each exactly once.

    "Once" is checked on the raw result parts, not on the export (which keeps one row per task
    whatever the parts hold): no task may have two `done` rows.
    """
    from jobs.schema import RESULT_SCHEMA, TaskState
    from storage.location import Location
    from storage.parts import read_parts

    raw, corrupt = read_parts(Location.of(job) / "results", RESULT_SCHEMA)
    assert not corrupt, corrupt
    done_ids = [t for t, s in zip(raw["task_id"].to_pylist(), raw["status"].to_pylist()) if s == TaskState.DONE]
    twice = sorted({t for t in done_ids if done_ids.count(t) > 1})
    assert not twice, f"task(s) with two done rows in the result parts: {twice}"
    rows = export_rows(job)
    ids = [r["doc_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"a document appears twice: {ids}"
    assert all(r["status"] == "done" for r in rows), rows
    assert len(done_ids) == len(rows)
    return {r["doc_id"]: r["summary"] for r in rows}


def license_manifest(tmp_path: Path, names: list[str]) -> Path:
    """manifest.jsonl of texts from /usr/share/common-licenses, each id the lower-cased file name."""
    return write_jsonl(tmp_path / "manifest.jsonl", [{"id": n.lower(), "path": str(LICENSES / n)} for n in names])


def start_submit(manifest: Path, job: Path, address: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`kvbatch submit` with the tiny config, left running in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "runner", "submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job),
         "--address", address, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, timeout: float = 300, poll: float = 0.005) -> bool:
    """True once `predicate()` holds; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    raise TimeoutError("condition not reached")
