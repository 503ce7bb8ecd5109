"""An `--address` (or $RAY_ADDRESS) where no Ray cluster answers is one clear line and exit 2, within
seconds, with nothing created: before, ray.init retried it for good (a refused loopback port: still
retrying after 10 minutes) or ended in a ConnectionError traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.cli import TINY_CONFIG, job_fingerprints, kvbatch, write_jsonl
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
