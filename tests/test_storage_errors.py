"""Storage problems the user fixes (no bucket, unknown credentials, no permission, no endpoint): one line
naming the URI and the fix, exit 2, never a traceback. A real S3-compatible server (moto) with IAM
checks on answers as S3 does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import TINY_CONFIG, kvbatch, write_jsonl
from tests.helpers.system import free_port, wait_for_server

BUCKET = "kvbatch-locked"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict]:
    """A moto server that checks credentials and IAM policies after the first requests set it up:
    one bucket, a user allowed everything and one allowed to read but not to write. Yields the endpoint
    and their keys."""
    import boto3

    # setup below makes 7 requests without authentication; every later one is checked
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "7"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(port, server)
        kw = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
              "aws_secret_access_key": "setup"}
        boto3.client("s3", **kw).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **kw)
        keys = {}
        for user, actions in (("reader", ["s3:GetObject", "s3:ListBucket"]), ("writer", ["s3:*"])):
            iam.create_user(UserName=user)
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
        yield {"endpoint": endpoint, **keys}
    finally:
        server.terminate()
        server.wait()


def _env(endpoint: str, key: tuple[str, str]) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key[0], "AWS_SECRET_ACCESS_KEY": key[1],
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _submit(tmp_path: Path, job: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short document."}])
    return kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", job, env=env, check=2, timeout=120)


@pytest.mark.parametrize(
    ("bucket", "who", "says"),
    [
        ("no-such-bucket", "writer", "bucket no-such-bucket does not exist"),
        (BUCKET, "unknown", "access denied"),
        (BUCKET, "reader", "access denied"),
    ],
    ids=["missing-bucket", "unknown-credentials", "no-write-permission"],
)
def test_submit_to_s3_that_cannot_be_written_is_one_line_naming_uri_and_fix(s3, tmp_path, bucket, who, says) -> None:
    key = s3[who] if who in s3 else ("AKIAUNKNOWN000000000", "wrong")
    job = f"s3://{bucket}/jobs/j1"
    line = _one_line_error(_submit(tmp_path, job, _env(s3["endpoint"], key)))
    assert job in line and says in line, line
    if says == "access denied":
        assert "AWS_ACCESS_KEY_ID" in line and "permission" in line


def test_an_unreachable_endpoint_is_one_line_naming_it(tmp_path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    line = _one_line_error(_submit(tmp_path, "s3://any-bucket/jobs/j1", _env(endpoint, ("k", "s"))))
    assert "s3://any-bucket/jobs/j1" in line and "cannot reach" in line and endpoint in line


def test_results_and_status_of_a_job_in_a_missing_bucket_exit_2(s3) -> None:
    env = _env(s3["endpoint"], s3["writer"])
    for command in (["results", "s3://no-such-bucket/jobs/j1"], ["status", "s3://no-such-bucket/jobs/j1"],
                    ["results", f"s3://{BUCKET}/jobs/never-made"]):
        line = _one_line_error(kvbatch(*command, env=env, check=2, timeout=120))
        assert command[1] in line and ("is not a job folder" in line or "does not exist" in line), line


GS_COMMANDS = {
    "submit -j": ["submit", "{manifest}", "-c", str(TINY_CONFIG), "-j", "gs://b/x"],
    "submit gs:// manifest": ["submit", "gs://b/docs.jsonl", "-c", str(TINY_CONFIG), "-j", "{tmp}/job"],
    "submit gs:// folder": ["submit", "gs://b/docs/", "-c", str(TINY_CONFIG), "-j", "{tmp}/job"],
    "resume": ["resume", "gs://b/x"],
    "status": ["status", "gs://b/x"],
    "results": ["results", "gs://b/x"],
}


@pytest.mark.parametrize("command", list(GS_COMMANDS))
def test_gs_is_refused_at_once_naming_what_to_use_instead(tmp_path: Path, command: str) -> None:
    """gs:// went to pyarrow's GCS filesystem, which waited 10 min for credentials with Ctrl-C ignored and
    SIGTERM too (issue 47, row 7): it is refused before any storage call, and no job folder is made."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short document."}])
    args = [a.format(manifest=manifest, tmp=tmp_path) for a in GS_COMMANDS[command]]
    line = _one_line_error(kvbatch(*args, check=2, timeout=30))
    assert "gs:// is not supported" in line and "s3://" in line and "file://" in line, line
    assert not (tmp_path / "job").exists()


def test_a_gs_path_in_a_manifest_row_is_a_rejected_row_naming_it(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "cloud", "path": "gs://b/doc.txt"},
                                                  {"id": "here", "text": "A short document."}])
    proc = kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"), "--strict",
                   check=2, timeout=30)
    rejected = [line for line in proc.stdout.splitlines() if line.strip().startswith("row ")]
    assert len(rejected) == 1 and "gs://b/doc.txt" in rejected[0], proc.stdout
    assert "gs:// is not supported" in rejected[0], proc.stdout
    assert "cannot be read" not in rejected[0] and "credentials" not in rejected[0], proc.stdout  # one reason
    assert not (tmp_path / "job").exists()
