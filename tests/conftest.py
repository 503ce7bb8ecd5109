"""Shared fixtures: one real local Ray instance per test session, the kvbatch CLI as a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs property tests derandomized: the same examples every run, so a random draw never blocks a landing
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
LICENSES = Path("/usr/share/common-licenses")
TINY_CONFIG = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """A real local Ray instance shared by every CLI run of the session (starting one costs seconds)."""
    import ray

    from runner.cluster import init_local_ray

    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(port: int, server: subprocess.Popen, timeout: float = 30) -> None:
    """Returns once `server` accepts connections on `port` on loopback; fails if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "the test server did not start"
            time.sleep(0.2)


def kvbatch(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
            check: int | None = None) -> subprocess.CompletedProcess[str]:
    """Runs the real CLI in a subprocess; `check` asserts its exit code."""
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


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


@contextmanager
def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A real tmpfs (`mount -o OPTIONS`) for the test; skips with the reason where mounting is not allowed."""
    mount_point.mkdir(exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command on this machine to make a small filesystem")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
