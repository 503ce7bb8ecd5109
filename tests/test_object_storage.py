"""A job folder on S3: a real S3-compatible server (moto) on 127.0.0.1, real Parquet, real kills.

The batch runs from `-j s3://...` with its documents on S3 too, is SIGKILLed mid-batch, resumed from
the URI alone, and must give the same summaries as the same batch in a local folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conftest import LICENSES, TINY_CONFIG, done_summaries, export_rows, kvbatch, license_manifest, wait_for, write_jsonl
from jobs.schema import RESULT_SCHEMA, TaskState, empty_row
from jobs.uris import filesystem_of
from storage.checkpoint import CheckpointLog, compact, load_state
from storage.lease import JobLease, job_lock
from storage.location import Location
from storage.lock import JobLockedError
from storage.parts import TEMP_PREFIX, list_parts, list_temp_files

DOCS = ["GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "Artistic", "BSD"]
BUCKET = "kvbatch-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """`s3://BUCKET` on a moto server this module starts; the AWS variables point every process at it."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto server did not start"
                time.sleep(0.2)
        filesystem_of(f"s3://{BUCKET}?allow_bucket_creation=true")[0].create_dir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        patch.undo()
        server.terminate()
        server.wait()


def _result(doc: str) -> dict:
    row = empty_row(RESULT_SCHEMA)
    row.update(doc_id=doc, task_id=f"t-{doc}", status=TaskState.DONE.value, summary=f"summary of {doc}", attempts=1)
    return row


def test_checkpoint_parts_on_s3_publish_whole_and_unpublished_keys_are_ignored(s3: str) -> None:
    job = Location.of(f"{s3}/parts-job")
    with CheckpointLog(job, flush_every=1) as log:
        for doc in ("a", "b", "c"):
            log.add_result(_result(doc))
    assert len(list_parts(job / "results")) == 3
    # a writer killed between its upload and the publish leaves only a temporary key behind
    stray = job / "results" / f"{TEMP_PREFIX}part-99999999999999999999-x.parquet"
    stray.write_bytes_atomic(b"half a part", ".ignored")
    state = load_state(job)
    assert state.done_task_ids == {"t-a", "t-b", "t-c"} and state.corrupt == []
    compact(job)
    assert len(list_parts(job / "results")) == 1 and list_temp_files(job / "results") == []
    assert load_state(job).done_task_ids == {"t-a", "t-b", "t-c"}


def test_the_lease_on_s3_admits_one_coordinator_and_takes_over_an_expired_one(s3: str) -> None:
    lock = Location.of(f"{s3}/lease-job/.lock")
    held = job_lock(lock)
    assert isinstance(held, JobLease)
    with held:
        with pytest.raises(JobLockedError, match="in use by a running coordinator"):
            JobLease(lock).acquire()
    assert not lock.exists(), "release removes the record"
    dead = {"host": "lost-node", "pid": 1, "start_time": 0.0, "token": "x", "expires": time.time() - 1}
    lock.write_bytes_atomic(json.dumps(dead).encode(), ".lock.tmp")
    with JobLease(lock) as taken:
        assert "pid 1 on host lost-node" in taken.takeover_message and "lease expired" in taken.takeover_message
    alive_elsewhere = {**dead, "expires": time.time() + 60}
    lock.write_bytes_atomic(json.dumps(alive_elsewhere).encode(), ".lock.tmp")
    with pytest.raises(JobLockedError, match="lost-node"):
        JobLease(lock).acquire()


def test_a_batch_on_s3_killed_and_resumed_from_the_uri_gives_the_local_results(s3, ray_address, tmp_path) -> None:
    local_job = tmp_path / "local-job"
    kvbatch("submit", str(license_manifest(tmp_path, DOCS)), "-c", str(TINY_CONFIG), "-j", str(local_job),
            "--address", ray_address, check=0)
    expected = done_summaries(str(local_job))

    documents, _ = filesystem_of(s3)
    for name in DOCS:
        with documents.open_output_stream(f"{BUCKET}/docs/{name}") as out:
            out.write((LICENSES / name).read_bytes())
    manifest = write_jsonl(tmp_path / "s3-manifest.jsonl",
                           [{"id": n.lower(), "path": f"{s3}/docs/{n}"} for n in DOCS])
    job = f"{s3}/jobs/killed"
    # its own local Ray: the workers read the documents from S3 with this environment's credentials
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "submit", str(manifest), "-c", str(TINY_CONFIG), "-j", job,
         "--set", "checkpoint.flush_every=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    reached = wait_for(lambda: len(list_parts(f"{job}/results")) >= 2, proc, poll=0.2)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    assert reached, f"the batch ended before the kill\n{out}\n{err}"
    assert len(list_parts(f"{job}/results")) < len(DOCS)

    status = json.loads(kvbatch("status", job, "--json", check=0).stdout)
    assert status["job_dir"] == job and status["counts"]["done"] >= 2
    resumed = kvbatch("resume", job, check=0)
    assert "took over stale lock" in resumed.stdout + resumed.stderr
    assert done_summaries(job) == expected
    assert not Location.of(f"{job}/.lock").exists()
    assert load_state(job).results.num_rows == len(DOCS)


def test_a_folder_on_s3_is_submitted_with_glob_and_a_manifest_uri_reads_documents_beside_it(s3, tmp_path) -> None:
    from test_formats import ACCEPTED, make_collection

    documents, _ = filesystem_of(s3)
    local = make_collection(tmp_path / "docs")
    for name in ("lease.pdf", "memo-cp1252.txt", "notes/release.md", "scan.pdf", ".hidden.txt"):
        with documents.open_output_stream(f"{BUCKET}/collection/{name}") as out:
            out.write((local / name).read_bytes())
    job = tmp_path / "job"
    # its own local Ray: the workers read the documents from S3 with this environment's credentials
    proc = kvbatch("submit", f"{s3}/collection/", "--glob", "*.pdf", "-c", str(TINY_CONFIG), "-j", str(job), check=0)
    assert "2 document(s) in s3://" in proc.stdout
    rows = {r["doc_id"]: r for r in export_rows(job, "--with-text")}
    assert {d: r["status"] for d, r in rows.items()} == {"lease.pdf": "done", "scan.pdf": "rejected"}
    assert rows["lease.pdf"]["text"] == ACCEPTED["lease.pdf"][1]

    manifest = [{"id": "memo", "path": "memo-cp1252.txt"}, {"id": "notes", "path": "notes/release.md"},
                {"id": "gone", "path": "nope.txt"}]
    with documents.open_output_stream(f"{BUCKET}/collection/manifest.jsonl") as out:
        out.write("".join(json.dumps(r) + "\n" for r in manifest).encode())
    proc = kvbatch("submit", f"{s3}/collection/manifest.jsonl", "--strict", "-c", str(TINY_CONFIG),
                   "-j", str(tmp_path / "strict"), check=2)
    out = " ".join(proc.stdout.split())
    assert "1 manifest row(s) rejected" in out and f"{s3}/collection/nope.txt does not exist" in out
    proc = kvbatch("submit", f"{s3}/nothing-here.jsonl", "-c", str(TINY_CONFIG), "-j", str(tmp_path / "x"), check=2)
    assert f"manifest {s3}/nothing-here.jsonl does not exist" in proc.stderr
