"""A job folder on S3: a real S3-compatible server (moto) on 127.0.0.1, real Parquet, real kills.

The batch runs from `-j s3://...` with its documents on S3 too, is SIGKILLed mid-batch, resumed from
the URI alone, and must give the same summaries as the same batch in a local folder.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from jobs.config import load_config
from jobs.faults import FAULTS_ENV
from jobs.manifest import read_manifest, tasks_to_table
from jobs.schema import RESULT_SCHEMA
from jobs.uris import filesystem_of
from storage.checkpoint import CheckpointLog, compact, load_state
from storage.jobdir import JobDir, JobInfo, create_job, new_job_id
from storage.lease import LEASE_TTL_ENV
from storage.location import Location
from storage.parts import TEMP_PREFIX, list_parts, list_temp_files
from storage.passes import read_passes, tasks_with_passes
from tests.helpers.cli import (
    LICENSES,
    REPO,
    TINY_CONFIG,
    done_summaries,
    export_rows,
    kvbatch,
    license_manifest,
    refusal,
    start_submit,
    wait_for,
    write_jsonl,
)
from tests.helpers.results import done_row
from tests.helpers.system import BUCKET

DOCS = ["GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "Artistic", "BSD"]
#: the two short ones: where the batch only has to finish, not to be caught mid-way
SHORT_DOCS = ["BSD", "CC0-1.0"]
#: one worker: how many there are is not the point anywhere here (each costs a torch import)
ONE_WORKER = ("--set", "workers.count=1")

RAY_PROCESS = """
import json, os, sys
import ray
from runner.cluster import init_local_ray
init_local_ray(num_cpus=2, log_to_driver=False)
print(json.dumps({"address": ray.get_runtime_context().gcs_address, "auth": os.environ.get("RAY_AUTH_MODE")}), flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""


@pytest.fixture(scope="module")
def s3_ray(s3: str) -> Iterator[str]:
    """A local Ray started in the `s3` fixture's environment, so its workers read documents from the
    bucket, like a cluster whose nodes hold the credentials (the session's Ray may predate them): one
    start for the module instead of a private Ray for each submit and resume. Every process here joins
    it in the auth mode `ray.init` set for its own (token: the token is in ~/.ray)."""
    ray = subprocess.Popen([sys.executable, "-c", RAY_PROCESS], cwd=REPO, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    patch = pytest.MonkeyPatch()
    try:
        line = ray.stdout.readline()
        assert line, f"the Ray process ended (exit {ray.wait()})"
        started = json.loads(line)
        if started["auth"] is not None:
            patch.setenv("RAY_AUTH_MODE", started["auth"])
        yield started["address"]
    finally:
        patch.undo()
        ray.stdin.close()
        try:
            ray.wait(timeout=60)
        except subprocess.TimeoutExpired:
            ray.kill()
            ray.wait()


def test_checkpoint_parts_on_s3_publish_whole_and_unpublished_keys_are_ignored(s3: str) -> None:
    job = Location.of(f"{s3}/parts-job")
    with CheckpointLog(job, flush_every=1) as log:
        for doc in ("a", "b", "c"):
            log.add_result(done_row(doc))
    assert len(list_parts(job / "results")) == 3
    # a writer killed between its upload and the publish leaves only a temporary key behind
    stray = job / "results" / f"{TEMP_PREFIX}part-99999999999999999999-x.parquet"
    stray.write_bytes_atomic(b"half a part", ".ignored")
    state = load_state(job)
    assert state.done_task_ids == {"t-a", "t-b", "t-c"} and state.corrupt == []
    compact(job)
    assert len(list_parts(job / "results")) == 1 and list_temp_files(job / "results") == []
    assert load_state(job).done_task_ids == {"t-a", "t-b", "t-c"}


def _create_job(uri: str, tmp_path, names: list[str], *overrides: str) -> None:
    """A job folder with open tasks and no coordinator: what `submit` leaves just before it runs."""
    config = load_config(TINY_CONFIG, ["workers.count=1", "checkpoint.flush_every=1", *overrides])
    manifest = write_jsonl(tmp_path / f"{abs(hash(uri))}.jsonl",
                           [{"id": n.lower(), "text": (LICENSES / n).read_text()} for n in names])
    tasks, _ = read_manifest(manifest, config.input)
    info = JobInfo(job_id=new_job_id(), created=time.time(), version="test", config=config.model_dump(mode="json"),
                   manifest_path=str(manifest), manifest_sha256="0" * 64)
    create_job(JobDir(uri), info, tasks_to_table(tasks), pa.Table.from_pylist([], schema=RESULT_SCHEMA))


#: the lease TTL of the two-coordinator tests: short, so a takeover waits seconds, yet each renewal (every
#: fifth of it, moto answering on a machine busy with the files running beside this one) has seconds
TEST_TTL_S = 8


def _coordinator_on(host: str, *args: str, ttl_s: float) -> subprocess.Popen:
    """`kvbatch ARGS` in a UTS namespace whose host name is `host`: a coordinator on another machine,
    as far as every host check is concerned (same bucket, same Ray)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-u", "true"]).returncode != 0:
        pytest.skip("needs `unshare -u` (root or user namespaces) to run a coordinator under another host name")
    command = f"hostname {host} && exec {sys.executable} -m runner " + " ".join(shlex.quote(a) for a in args)
    return subprocess.Popen(["unshare", "-u", "sh", "-c", command], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, LEASE_TTL_ENV: str(ttl_s)})


def _keys(uri: str) -> dict[str, int]:
    """Every object under the job prefix, with its size: what a coordinator wrote."""
    fs, path = filesystem_of(uri)
    return {info.path: info.size for info in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if info.type == pafs.FileType.File}


def test_two_coordinators_started_together_one_runs_and_the_other_exits_clearly(s3, s3_ray, tmp_path) -> None:
    job = f"{s3}/jobs/together"
    _create_job(job, tmp_path, SHORT_DOCS)
    procs = {host: _coordinator_on(host, "resume", job, "--address", s3_ray, ttl_s=TEST_TTL_S)
             for host in ("node-a", "node-b")}
    outcomes = {host: (proc.wait(timeout=600), proc.stdout.read() + proc.stderr.read()) for host, proc in procs.items()}
    codes = sorted(code for code, _ in outcomes.values())
    assert codes == [0, 2], outcomes
    [(winner, _)] = [(h, o) for h, (c, o) in outcomes.items() if c == 0]
    [(loser_output)] = [o for c, o in outcomes.values() if c == 2]
    assert "is in use by a running coordinator" in loser_output and f"on host {winner}" in loser_output
    assert "Traceback" not in loser_output
    assert set(done_summaries(job)) == {n.lower() for n in SHORT_DOCS}
    assert not Location.of(f"{job}/.lock").exists()


def _unpublished(key: str) -> bool:
    """A write's temporary key (a part's or job.log's), which no reader lists."""
    name = key.rpartition("/")[2]
    return name.startswith(TEMP_PREFIX) or name.endswith(".tmp")


def test_a_paused_holder_whose_lease_is_taken_writes_nothing_after_it_resumes(s3, s3_ray, tmp_path) -> None:
    job = f"{s3}/jobs/paused"
    _create_job(job, tmp_path, DOCS)
    paused = _coordinator_on("node-a", "resume", job, "--address", s3_ray, ttl_s=TEST_TTL_S)
    try:
        reached = wait_for(lambda: len(list_parts(f"{job}/results")) >= 1, paused, poll=0.05)
        assert reached, paused.communicate()
        paused.send_signal(signal.SIGSTOP)
        taker = kvbatch("resume", job, "--address", s3_ray, env={LEASE_TTL_ENV: str(TEST_TTL_S)}, check=0)
        said = taker.stdout + taker.stderr
        assert "took over stale lock" in said and f"not renewed for {TEST_TTL_S} s" in said
        written_by_taker = _keys(job)
        summaries = done_summaries(job)
        paused.send_signal(signal.SIGCONT)
        out, err = paused.communicate(timeout=300)
    finally:
        paused.send_signal(signal.SIGCONT)
        paused.kill()
    assert paused.returncode == 5, out + err
    assert "lost the job lease" in out + err and "wrote nothing since" in out + err
    left = _keys(job)
    assert left.items() <= written_by_taker.items(), "the paused coordinator wrote after its lease was taken"
    # all it may do is drop its own temporary key: stopped mid-upload, its publish was fenced off
    assert all(_unpublished(k) for k in written_by_taker.keys() - left.keys()), written_by_taker.keys() - left.keys()
    assert done_summaries(job) == summaries and set(summaries) == {n.lower() for n in DOCS}
    assert load_state(job).results.num_rows == len(DOCS)


def test_a_batch_on_s3_killed_and_resumed_from_the_uri_gives_the_local_results(s3, s3_ray, tmp_path) -> None:
    local_job = tmp_path / "local-job"
    kvbatch("submit", str(license_manifest(tmp_path, DOCS)), "-c", str(TINY_CONFIG), "-j", str(local_job),
            "--address", s3_ray, *ONE_WORKER, check=0)
    expected = done_summaries(str(local_job))

    documents, _ = filesystem_of(s3)
    for name in DOCS:
        with documents.open_output_stream(f"{BUCKET}/docs/{name}") as out:
            out.write((LICENSES / name).read_bytes())
    manifest = write_jsonl(tmp_path / "s3-manifest.jsonl",
                           [{"id": n.lower(), "path": f"{s3}/docs/{n}"} for n in DOCS])
    job = f"{s3}/jobs/killed"
    # gpl-2 hangs once its chunks are kept: the batch cannot end between the second result and the kill
    proc = start_submit(manifest, job, s3_ray, "--set", "checkpoint.flush_every=1", *ONE_WORKER,
                        env={FAULTS_ENV: json.dumps([{"doc": "gpl-2", "fault": "hang"}])})
    reached = wait_for(lambda: len(list_parts(f"{job}/results")) >= 2, proc, poll=0.2)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    assert reached, f"the batch ended before the kill\n{out}\n{err}"
    assert len(list_parts(f"{job}/results")) < len(DOCS)

    status = json.loads(kvbatch("status", job, "--json", check=0).stdout)
    assert status["job_dir"] == job and status["counts"]["done"] >= 2
    resumed = kvbatch("resume", job, "--address", s3_ray, check=0)
    assert "took over stale lock" in resumed.stdout + resumed.stderr
    assert done_summaries(job) == expected
    assert not Location.of(f"{job}/.lock").exists()
    assert load_state(job).results.num_rows == len(DOCS)


#: three long licence texts at a 512-token context: 4 to 17 chunks each, then merge rounds
LONG_DOCS = ["GPL-2", "LGPL-2.1", "Apache-2.0"]
SHORT_CONTEXT = ("--set", "summarize.context_tokens=512", "--set", "summarize.min_context_tokens=256",
                 "--set", "checkpoint.flush_every=1")


def _unfinished_passes(job: str) -> dict[str, int]:
    """task id -> passes kept on S3 of a document not done (a folder removed as it is read: done by now)."""
    done = load_state(job).done_task_ids  # before the passes: a document done after this has its passes still
    kept = {}
    for task_id in tasks_with_passes(job):
        if task_id not in done:
            try:
                kept[task_id] = len(read_passes(job, task_id))
            except OSError:  # its result landed and its folder went meanwhile
                continue
    return {t: n for t, n in kept.items() if n}


def test_a_batch_on_s3_killed_mid_document_then_two_racing_resumes_run_only_the_passes_not_finished(
        s3, s3_ray, tmp_path) -> None:
    """The coordinator alone keeps finished passes on S3; after kill -9 two resumes race for the job, exactly
    one runs it, reuses every pass kept before the kill and runs each of the others once."""
    local_job = tmp_path / "local-job"
    manifest = license_manifest(tmp_path, LONG_DOCS)
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(local_job), "--address", s3_ray,
            *ONE_WORKER, *SHORT_CONTEXT, check=0)
    expected = {row["doc_id"]: row for row in export_rows(local_job)}
    assert all(row["passes"] > row["chunks"] > 3 for row in expected.values()), expected

    job = f"{s3}/jobs/passes-killed"
    # lgpl-2.1's attempt hangs once its chunks are kept, before its merges: the rest of the batch may end within
    # one poll of the bucket, and the kill must still find a document half done
    hang = json.dumps([{"doc": "lgpl-2.1", "fault": "hang"}])
    proc = start_submit(manifest, job, s3_ray, *ONE_WORKER, *SHORT_CONTEXT,
                        env={LEASE_TTL_ENV: str(TEST_TTL_S), FAULTS_ENV: hang})
    reached = wait_for(lambda: Location.of(f"{job}/job.json").exists() and bool(_unfinished_passes(job)), proc,
                       poll=0.1)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    assert reached, f"the batch ended before a document's passes were kept\n{out}\n{err}"
    done_at_kill = load_state(job).done_task_ids
    kept = _unfinished_passes(job)
    assert kept and len(done_at_kill) < len(LONG_DOCS)

    procs = {host: _coordinator_on(host, "resume", job, "--address", s3_ray, ttl_s=TEST_TTL_S)
             for host in ("node-a", "node-b")}
    outcomes = {host: (proc.wait(timeout=600), proc.stdout.read() + proc.stderr.read()) for host, proc in procs.items()}
    assert sorted(code for code, _ in outcomes.values()) == [0, 2], outcomes
    rows = {row["doc_id"]: row for row in export_rows(job)}
    assert {d: r["summary"] for d, r in rows.items()} == {d: r["summary"] for d, r in expected.items()}
    resumed = {row["task_id"]: row for row in rows.values() if row["task_id"] not in done_at_kill}
    assert {t: resumed[t]["passes_reused"] for t in kept} == kept  # every kept pass read back, none run again
    assert all(row["passes"] == expected[row["doc_id"]]["passes"] for row in resumed.values())
    assert not tasks_with_passes(job) or not any(read_passes(job, t) for t in tasks_with_passes(job))
    assert not Location.of(f"{job}/.lock").exists()


def test_a_folder_on_s3_is_submitted_with_glob_and_a_manifest_uri_reads_documents_beside_it(s3, s3_ray, tmp_path
                                                                                              ) -> None:
    from tests.helpers.collection import ACCEPTED, make_collection

    documents, _ = filesystem_of(s3)
    local = make_collection(tmp_path / "docs")
    for name in ("lease.pdf", "memo-cp1252.txt", "notes/release.md", "scan.pdf", ".hidden.txt"):
        with documents.open_output_stream(f"{BUCKET}/collection/{name}") as out:
            out.write((local / name).read_bytes())
    job = tmp_path / "job"
    proc = kvbatch("submit", f"{s3}/collection/", "--glob", "*.pdf", "-c", str(TINY_CONFIG), "-j", str(job),
                   "--address", s3_ray, check=3)
    assert "2 document(s) in s3://" in proc.stdout
    rows = {r["doc_id"]: r for r in export_rows(job, "--with-text")}
    assert {d: r["status"] for d, r in rows.items()} == {"lease.pdf": "done", "scan.pdf": "rejected"}
    assert rows["lease.pdf"]["text"] == ACCEPTED["lease.pdf"][1]

    manifest = [{"id": "memo", "path": "memo-cp1252.txt"}, {"id": "notes", "path": "notes/release.md"},
                {"id": "gone", "path": "nope.txt"}]
    with documents.open_output_stream(f"{BUCKET}/collection/manifest.jsonl") as out:
        out.write("".join(json.dumps(r) + "\n" for r in manifest).encode())
    proc = refusal("submit", f"{s3}/collection/manifest.jsonl", "--strict", "-c", str(TINY_CONFIG),
                   "-j", str(tmp_path / "strict"))
    out = " ".join(proc.stdout.split())
    assert "1 manifest row(s) rejected" in out and f"{s3}/collection/nope.txt does not exist" in out
    proc = refusal("submit", f"{s3}/nothing-here.jsonl", "-c", str(TINY_CONFIG), "-j", str(tmp_path / "x"))
    assert f"manifest {s3}/nothing-here.jsonl does not exist" in proc.stderr
