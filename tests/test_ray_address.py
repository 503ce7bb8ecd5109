"""An `--address` (or $RAY_ADDRESS) where no Ray cluster answers is one clear line and exit 2, within
seconds, with nothing created: before, ray.init retried it for good (a refused loopback port: still
retrying after 10 minutes) or ended in a ConnectionError traceback. Without one, a submit starts a
private loopback Ray whatever a `ray_current_cluster` file names, and a Ray that cannot start is one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import (
    REPO,
    TINY_CONFIG,
    export_rows,
    job_fingerprints,
    kvbatch,
    license_manifest,
    wait_for,
    write_jsonl,
)
from tests.helpers.system import free_port

#: TEST-NET-1 (RFC 5737): never a Ray cluster; a connection to it times out or, where the network answers
#: for it (this sandbox), is refused
UNROUTED = "192.0.2.1:6379"


def _closed_loopback_port() -> str:
    return f"127.0.0.1:{free_port()}"


def _manifest(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "The council met about the roads and agreed."}])


@pytest.mark.parametrize("where", ["refused", "unrouted"])
def test_submit_to_an_address_where_no_ray_answers_is_one_line_and_creates_nothing(tmp_path: Path, where: str) -> None:
    address = _closed_loopback_port() if where == "refused" else UNROUTED
    job = tmp_path / "job"
    proc = kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", address,
                   timeout=90, check=2)
    out = " ".join(proc.stderr.split())
    assert f"no Ray cluster answers at {address}" in out, proc.stdout + proc.stderr
    assert "ray start --head" in out and "--address" in out
    assert "Traceback" not in proc.stderr
    assert not job.exists()


def test_resume_through_a_ray_address_variable_where_no_ray_answers_leaves_the_job_as_it_was(
        tmp_path: Path, ray_address: str) -> None:
    job = tmp_path / "job"  # its one task failed, so `resume --retry-failed` has a task to run on Ray
    kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            "--set", "workers.count=1", "--set", "retry.max_attempts=1", "--set", "summarize.min_context_tokens=1024",
            env={"KVBATCH_FAULTS": json.dumps([{"doc": "a", "fault": "io"}])}, check=3)
    before = job_fingerprints(job)
    address = _closed_loopback_port()
    proc = kvbatch("resume", str(job), "--retry-failed", env={"RAY_ADDRESS": address}, timeout=90, check=2)
    assert f"no Ray cluster answers at {address}" in " ".join(proc.stderr.split()), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert job_fingerprints(job) == before


def test_a_token_cluster_joined_without_ray_auth_mode_says_to_set_it(tmp_path: Path, ray_address: str) -> None:
    """The session's Ray uses token authentication (ray.init's default, like `ray start`'s); Ray sends no
    token to an address given explicitly unless RAY_AUTH_MODE=token says so, and the cluster refuses it."""
    if os.environ.get("RAY_AUTH_MODE") != "token":
        pytest.skip("the session's Ray runs without token authentication (RAY_AUTH_MODE is set otherwise)")
    job = tmp_path / "job"
    proc = kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
                   # Ray's own connect attempts (one a second): fail in seconds, not 20
                   env={"RAY_NUM_REDIS_GET_RETRIES": "2"}, unset=("RAY_AUTH_MODE",), timeout=120, check=2)
    out = " ".join(proc.stderr.split())
    assert f"no Ray cluster answers at {ray_address}" in out, proc.stderr
    assert "set RAY_AUTH_MODE=token" in out
    assert "Traceback" not in proc.stderr
    assert not job.exists()


# -- without --address: a private loopback Ray, whatever ray_current_cluster says -----------------------------

@contextmanager
def _private_ray_tmpdir() -> Iterator[Path]:
    """A RAY_TMPDIR of the test's own, short (Ray's socket paths must stay under 108 bytes), never /tmp/ray."""
    folder = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _ray_start_head(ray_tmpdir: Path) -> Iterator[Path]:
    """`ray start --head --block` with RAY_TMPDIR=ray_tmpdir; yields its session folder. Ends it and every
    process it started, by pid (a `ray stop` would end other sessions' Ray too)."""
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmpdir)}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             f"--port={free_port()}", "--num-cpus=1", "--include-dashboard=false"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address_file = ray_tmpdir / "ray" / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 120
        while not address_file.exists():
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.2)
        yield (ray_tmpdir / "ray" / "session_latest").resolve()
    finally:
        family = [head.pid, *(p.pid for p in psutil.Process(head.pid).children(recursive=True))] \
            if head.poll() is None else [head.pid]
        for pid in family:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        head.wait()


def _submit_on_a_private_ray(tmp_path: Path, ray_tmpdir: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"),
                   "--set", "workers.count=1", env={"RAY_TMPDIR": str(ray_tmpdir)}, unset=("RAY_ADDRESS",),
                   timeout=timeout)


def test_a_stale_ray_current_cluster_file_neither_hangs_nor_captures_a_submit(tmp_path: Path) -> None:
    """ray.init() joins what $RAY_TMPDIR/ray/ray_current_cluster names: a file left by a cluster that ended
    uncleanly had a submit retry "Failed to connect to GCS" for good (still hanging at 240 s)."""
    with _private_ray_tmpdir() as ray_tmpdir:
        (ray_tmpdir / "ray").mkdir()
        (ray_tmpdir / "ray" / "ray_current_cluster").write_text(_closed_loopback_port() + "\n")
        proc = _submit_on_a_private_ray(tmp_path, ray_tmpdir, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert [r["status"] for r in export_rows(tmp_path / "job")] == ["done"]


def test_a_submit_without_an_address_does_not_join_a_ray_start_cluster_on_the_machine(tmp_path: Path) -> None:
    with _private_ray_tmpdir() as ray_tmpdir, _ray_start_head(ray_tmpdir) as session:
        logs = session / "logs"
        before = set(logs.iterdir())
        proc = _submit_on_a_private_ray(tmp_path, ray_tmpdir, timeout=240)
        joined = sorted(p.name for p in set(logs.iterdir()) - before if p.name.startswith(("python-core", "worker")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not joined, f"the submit joined the `ray start` cluster: its session logs gained {joined}"
    assert [r["status"] for r in export_rows(tmp_path / "job")] == ["done"]


def test_a_local_ray_that_cannot_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "ray-tmp"
    not_a_folder.write_text("a file where Ray wants its temporary folder\n")
    job = tmp_path / "job"
    proc = kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job),
                   env={"RAY_TMPDIR": str(not_a_folder)}, unset=("RAY_ADDRESS",), timeout=120, check=2)
    assert "a private local Ray could not start here" in " ".join(proc.stderr.split()), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert not job.exists()


def test_a_submit_killed_with_sigkill_takes_its_ray_processes_with_it(tmp_path: Path) -> None:
    """The dashboard and runtime-env agents (the raylet's children) outlived a `kill -9` of the submit for a
    minute and more: they waited out a 60 s call to the GCS that had died with it."""
    manifest = license_manifest(tmp_path, ["GPL-2", "LGPL-2.1"])
    job = tmp_path / "job"
    with _private_ray_tmpdir() as ray_tmpdir:
        env = {**os.environ, "RAY_TMPDIR": str(ray_tmpdir)}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", str(manifest), "-c", str(TINY_CONFIG),
                                 "-j", str(job), "--set", "workers.count=1"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        family: list[psutil.Process] = []
        try:  # the moment: a task has run, so every Ray process (agents, worker) is up
            assert wait_for(lambda: any((job / "events").glob("*.parquet")), proc, timeout=240), "the submit ended"
            family = psutil.Process(proc.pid).children(recursive=True)
            assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet"} <= {p.name() for p in family}
            proc.kill()
            proc.wait()
            _, alive = psutil.wait_procs(family, timeout=20)
            assert not alive, f"left behind after kill -9: {[(p.pid, p.name()) for p in alive]}"
        finally:
            proc.kill()
            for process in family:
                with suppress(psutil.Error):
                    process.kill()
