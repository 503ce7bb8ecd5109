"""A long document's finished passes go back from the workers to the coordinator, which alone
checkpoints them (storage/passes.py) before anything that depends on them is dealt: a resume after
kill -9 runs only the passes not kept, a transient retry or a move down the cache ladder only the pass
that failed; the summaries stay token for token those of an uninterrupted run, and no pass is kept twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.config import JobConfig, load_config
from jobs.faults import FAULTS_ENV
from jobs.passes import pass_key, settings_fingerprint
from jobs.schema import MANIFEST_SCHEMA, PASS_SCHEMA
from jobs.task import Task
from storage.checkpoint import CheckpointLog, load_state
from storage.lease import LeaseLostError
from storage.location import Location
from storage.parts import TEMP_PREFIX, list_parts, read_parts, write_part
from storage.passes import read_passes, remove_passes, tasks_with_passes, write_passes
from tests.helpers.cli import (
    LICENSES,
    REPO,
    TINY_CONFIG,
    export_rows,
    kvbatch,
    license_manifest,
    start_submit,
    wait_for,
)
from tests.helpers.results import kept_pass

#: six long licence texts: 4 to 17 chunks each at a 512-token context, a merge round or two above them
LONG_DOCS = ["LGPL-2.1", "GPL-2", "MPL-2.0", "Apache-2.0", "LGPL-3", "Artistic"]
SHORT_CONTEXT = ["--set", "summarize.context_tokens=512", "--set", "summarize.min_context_tokens=256",
                 "--set", "checkpoint.flush_every=1"]


#: what reading a pass folder says when its document's result landed and the folder was cleaned meanwhile
CLEANED_WHILE_READ = "removed while being read"


def saved_passes(job: Path, *, running: bool = False) -> dict[str, int]:
    """task id -> finished passes published in the job folder now. While the batch runs, a folder cleaned
    as it is read is left out: its document is done by the time the results are read after it."""
    found = {}
    for folder in sorted((job / "passes").glob("*")):
        table, corrupt = read_parts(folder, PASS_SCHEMA)
        if running and corrupt and all(part.reason.startswith(CLEANED_WHILE_READ) for part in corrupt):
            continue
        assert not corrupt, corrupt
        if table.num_rows:
            found[folder.name] = len(set(table["key"].to_pylist()))
    return found


class PartWatch:
    """Every pass part that ever appears in a job folder while a batch runs, read as it appears (a
    document's parts go once its result is published): which key each part kept."""

    def __init__(self, job: Path) -> None:
        self.job = job
        self.keys: dict[str, list[str]] = {}  # part path -> the keys of the passes it kept

    def look(self) -> int:
        try:
            parts = list((self.job / "passes").glob("*/part-*.parquet"))
        except FileNotFoundError:  # a document's folder was cleaned while it was listed: look again next time
            return len(self.keys)
        for part in parts:
            if str(part) not in self.keys:
                try:
                    self.keys[str(part)] = pq.read_table(part, columns=["key"])["key"].to_pylist()
                except (FileNotFoundError, OSError):  # its document was done and its folder cleaned meanwhile
                    continue
        return len(self.keys)

    def kept(self) -> set[str]:
        return {key for keys in self.keys.values() for key in keys}

    def twice(self) -> dict[str, int]:
        """Keys kept more than once."""
        counts: dict[str, int] = {}
        for key in (key for keys in self.keys.values() for key in keys):
            counts[key] = counts.get(key, 0) + 1
        return {key: n for key, n in counts.items() if n > 1}


def rows_by_doc(job: Path) -> dict[str, dict]:
    return {row["doc_id"]: row for row in export_rows(job)}


@pytest.fixture(scope="module")
def uninterrupted_job(ray_address, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    kvbatch("submit", str(license_manifest(tmp, LONG_DOCS)), "-c", str(TINY_CONFIG), "-j", str(tmp / "job"),
            "--address", ray_address, *SHORT_CONTEXT, check=0)
    return tmp / "job"


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_job) -> dict[str, dict]:
    tmp = uninterrupted_job.parent
    rows = rows_by_doc(tmp / "job")
    assert all(row["passes"] > row["chunks"] > 3 for row in rows.values()), rows  # chunks and merges
    assert not (tmp / "job" / "passes").exists() or not any((tmp / "job" / "passes").iterdir())
    return rows


def test_a_kill_at_seventy_percent_then_resume_redoes_no_finished_pass(uninterrupted, ray_address, tmp_path):
    total = sum(row["passes"] for row in uninterrupted.values())
    job = tmp_path / "job"
    # lgpl-2.1's attempt hangs once its chunks are kept, before its merges: on the tiny model the rest of the
    # batch takes a second, and the kill must still find a document half done
    hang = json.dumps([{"doc": "lgpl-2.1", "fault": "hang"}])
    proc = start_submit(license_manifest(tmp_path, LONG_DOCS), job, ray_address, *SHORT_CONTEXT,
                        env={FAULTS_ENV: hang})

    def seventy_percent_with_a_document_half_done() -> bool:
        if not (job / "job.json").exists():
            return False
        saved = saved_passes(job, running=True)
        state = load_state(job)  # after the passes: a folder cleaned meanwhile is of a document done by now
        finished = sum(row["passes"] for row in state.results.to_pylist())
        in_progress = {t: n for t, n in saved.items() if t not in state.done_task_ids}
        return finished + sum(in_progress.values()) >= 0.7 * total and bool(in_progress)

    watch = PartWatch(job)
    reached = wait_for(lambda: watch.look() >= 0 and seventy_percent_with_a_document_half_done(), proc, poll=0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached, "the batch finished before the kill"
    watch.look()
    assert not watch.twice(), f"passes kept twice before the kill: {watch.twice()}"
    done_at_kill = load_state(job).done_task_ids
    kept = {t: n for t, n in saved_passes(job).items() if t not in done_at_kill}
    assert kept and len(done_at_kill) < len(LONG_DOCS)

    kvbatch("resume", str(job), "--address", ray_address, check=0)
    rows = rows_by_doc(job)
    assert {d: r["summary"] for d, r in rows.items()} == {d: r["summary"] for d, r in uninterrupted.items()}
    resumed = {row["task_id"]: row for row in rows.values() if row["task_id"] not in done_at_kill}
    # every pass finished before the kill was read back, none ran again; the rest ran once
    assert {t: resumed[t]["passes_reused"] for t in kept} == kept
    assert all(row["passes"] == uninterrupted[row["doc_id"]]["passes"] for row in resumed.values())
    redone = sum(row["passes"] - row["passes_reused"] for row in resumed.values())
    print(f"\n{total} passes; at the kill {len(done_at_kill)} documents done and {sum(kept.values())} passes kept "
          f"of {len(kept)} unfinished ones; the resume ran {redone} passes")
    assert redone == total - sum(uninterrupted[r["doc_id"]]["passes"] for r in rows.values()
                                 if r["task_id"] in done_at_kill) - sum(kept.values())
    assert not any((job / "passes").iterdir())  # each document's passes went with its result


LONG = LICENSES / "GPL-2"  # 17 chunks at a 512-token context, then merges
#: two workers; passes long enough (48 tokens each) that one document's passes are in flight for seconds
TWO_WORKERS = ["--set", "workers.count=2", "--set", "summarize.context_tokens=512",
               "--set", "summarize.min_context_tokens=256", "--set", "batch.max_sequences=2",
               "--set", "summarize.max_new_tokens=48", "--set", "summarize.generation.min_new_tokens=48",
               "--set", "checkpoint.flush_every=1"]


def test_two_workers_killed_and_resumed_keep_every_pass_once(ray_address, tmp_path):
    """Two workers at long documents (the default settings), killed mid-way and resumed: each pass is
    run and kept once, before the kill or after it."""
    job = tmp_path / "job"
    proc = start_submit(license_manifest(tmp_path, LONG_DOCS), job, ray_address, *TWO_WORKERS)
    watch = PartWatch(job)
    reached = wait_for(lambda: watch.look() >= 0 and len(watch.kept()) >= 40, proc, poll=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached, "the batch finished before the kill"
    resume = subprocess.Popen([sys.executable, "-m", "runner", "resume", str(job), "--address", ray_address],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: watch.look() < 0, resume, poll=0.05)  # until the resume ends
    assert resume.wait() == 0, resume.stderr.read()
    rows = rows_by_doc(job)
    assert all(row["status"] == "done" for row in rows.values()) and len(rows) == len(LONG_DOCS)
    assert len(watch.kept()) <= sum(row["passes"] for row in rows.values())
    assert not watch.twice(), f"{len(watch.keys)} parts for {len(watch.kept())} passes: {watch.twice()}"


def _worker_cpu_s(job: Path) -> dict[int, float]:
    """CPU seconds used so far by each worker process of the batch (from its `worker_ready` line)."""
    log = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    pids = {int(e["worker"].rsplit(":", 1)[1]) for e in log if e["event"] == "worker_ready"}
    return {pid: sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids}


def test_while_the_coordinator_is_stopped_nothing_writes_the_job_folder(ray_address, tmp_path):
    """The coordinator, holding the job's lock, is the only writer of the job folder: its workers hand
    finished passes back to it, and go on computing while it is stopped without writing a byte there."""
    job = tmp_path / "job"
    # passes of 1,000 tokens: those in flight when the coordinator stops keep the workers busy for seconds
    long_passes = ["--set", "summarize.context_tokens=4096", "--set", "summarize.min_context_tokens=3100",
                   "--set", "summarize.max_new_tokens=1000", "--set", "summarize.generation.min_new_tokens=1000"]
    proc = start_submit(license_manifest(tmp_path, LONG_DOCS), job, ray_address, *TWO_WORKERS, *long_passes)
    try:
        reached = wait_for(lambda: bool(list((job / "passes").glob("*/part-*.parquet"))), proc, poll=0.05)
        assert reached, proc.communicate()
        assert wait_for(lambda: "worker_ready" in (job / "job.log").read_text(), proc)
        proc.send_signal(signal.SIGSTOP)
        before = {p: p.stat().st_mtime_ns for p in job.rglob("*") if p.is_file()}
        cpu = _worker_cpu_s(job)
        deadline = time.monotonic() + 120
        # the moment under test: the workers compute for a while (a CPU second between them)
        while sum(_worker_cpu_s(job).values()) - sum(cpu.values()) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        grew = sum(_worker_cpu_s(job).values()) - sum(cpu.values())
        after = {p: p.stat().st_mtime_ns for p in job.rglob("*") if p.is_file()}
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert grew >= 1.0, f"the workers computed {grew:.1f} CPU seconds while the coordinator was stopped"
    written = sorted(str(p.relative_to(job)) for p in after.keys() - before.keys())
    assert not written, f"written while the coordinator was stopped: {written}"


def test_a_retry_and_a_move_down_the_ladder_run_only_the_pass_that_failed(uninterrupted, ray_address, tmp_path):
    # the faults strike the pass whose summary is the document's, once every pass before it was kept
    faults = json.dumps([{"doc": "gpl-2", "fault": "io", "attempts": [1]},
                         {"doc": "mpl-2.0", "fault": "oom", "rungs": ["dynamic"]}])
    job = tmp_path / "job"
    kvbatch("submit", str(license_manifest(tmp_path, ["GPL-2", "MPL-2.0", "Artistic"])), "-c", str(TINY_CONFIG),
            "-j", str(job), "--address", ray_address, *SHORT_CONTEXT, "--set", "retry.backoff_initial_s=0",
            env={"KVBATCH_FAULTS": faults}, check=0)
    rows = rows_by_doc(job)
    retried, moved = rows["gpl-2"], rows["mpl-2.0"]
    assert retried["attempts"] == 2 and moved["attempts"] == 1
    assert moved["fallbacks"] and moved["cache_strategy"] != "dynamic"
    log = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    for doc_id, row in rows.items():
        kept = [(e["level"], e["index"]) for e in log if e["event"] == "pass_kept" and e["doc_id"] == doc_id]
        assert len(kept) == len(set(kept)) == row["passes"], doc_id  # every pass ran and was kept once
        runs = [e for e in log if e["event"] == "pass_assigned" and e["doc_id"] == doc_id]
        assert len(runs) == row["passes"], doc_id  # a retry runs the failed pass again, not the document
        assert row["passes_reused"] == 0
    assert {d: r["summary"] for d, r in rows.items()} == {d: uninterrupted[d]["summary"] for d in rows}


def test_a_pass_key_is_the_same_exactly_when_running_it_again_gives_the_same_tokens():
    fingerprint = settings_fingerprint(JobConfig(), "cpu", "torch.float32")
    key = pass_key(fingerprint, [1, 2, 3], 16)
    assert pass_key(fingerprint, [1, 2, 3], 16) == key  # a shorter context whose plan gives the same prompt
    assert pass_key(fingerprint, [1, 2, 4], 16) != key and pass_key(fingerprint, [1, 2, 3], 17) != key
    other = settings_fingerprint(JobConfig(summarize={"seed": 1}), "cpu", "torch.float32")
    assert other != fingerprint and pass_key(other, [1, 2, 3], 16) != key
    # where the KV lives, the context and the prefill chunking do not decide tokens: same fingerprint
    assert settings_fingerprint(JobConfig(cache={"strategy": "tiered-disk"}, summarize={"context_tokens": 2048}),
                                "cpu", "torch.float32") == fingerprint


def test_the_checkpoint_log_publishes_passes_fenced_as_they_are_added(tmp_path):
    lease = {"held": True}

    def fence() -> None:
        if not lease["held"]:
            raise LeaseLostError("the lease was taken")

    log = CheckpointLog(tmp_path, flush_every=100, fence=fence)
    log.add_passes([kept_pass("t-a", "k1"), kept_pass("t-b", "k2")])
    log.add_passes([kept_pass("t-a", "k3")])
    assert sorted(tasks_with_passes(tmp_path)) == ["t-a", "t-b"]
    assert sorted(row["key"] for row in read_passes(tmp_path, "t-a")) == ["k1", "k3"]
    lease["held"] = False
    with pytest.raises(LeaseLostError):
        log.add_passes([kept_pass("t-a", "k4")])
    assert sorted(row["key"] for row in read_passes(tmp_path, "t-a")) == ["k1", "k3"]  # nothing written unfenced


def test_a_pass_kept_by_a_tree_before_pass_timings_still_resumes_with_none(tmp_path):
    """A job folder from before passes said their timings: its parts lack the two columns, which read as null."""
    older = pa.schema([field for field in PASS_SCHEMA if field.name not in ("prefill_s", "decode_s", "batch_size")])
    row = {name: value for name, value in kept_pass("t-a", "k1").items() if name in older.names}
    write_part(tmp_path / "passes" / "t-a", pa.Table.from_pylist([row], schema=older))
    [read] = read_passes(tmp_path, "t-a")
    assert read["key"] == "k1" and read["tokens"] == [7]
    assert (read["prefill_s"], read["decode_s"]) == (None, None)


# ---------------------------------------------------------------- only kvbatch's own passes are removed

#: the temporary name of a pass part whose write never completed (storage/parts.py names them so)
UNFINISHED = f"{TEMP_PREFIX}part-00000000000000000007-00000003-4242-abcdef.parquet"
#: files that are not kvbatch's, in folders of passes/: (folder, name); t000009 and holiday are no task of the job
FOREIGN = [("holiday", "photo.jpg"), ("t000009", "draft.txt"), ("t000001", "notes.txt"),
           ("t000002", "part-mine.parquet")]


def _own_and_foreign_passes(job: Location) -> None:
    """A job of tasks t000001 and t000002 (its manifest.parquet); t000001 has a part and an unfinished
    write, and every folder of passes/ also holds a file someone else put there."""
    job.makedirs()
    manifest = pa.Table.from_pylist([{"task_id": t, "doc_id": t} for t in ("t000001", "t000002")],
                                    schema=MANIFEST_SCHEMA)
    (job / "manifest.parquet").write_atomic(lambda handle: pq.write_table(manifest, handle), ".manifest.tmp")
    write_passes(job, "t000001", [kept_pass("t000001", "k1")])
    (job / "passes" / "t000001" / UNFINISHED).write_bytes_atomic(b"half a part", ".unfinished.tmp")
    for folder, name in FOREIGN:
        (job / "passes" / folder).makedirs()
        (job / "passes" / folder / name).write_bytes_atomic(b"not kvbatch's", f".{name}.tmp")


def _files_in_passes(job: Location) -> list[str]:
    passes = job / "passes"
    return sorted(f"{folder}/{f.name}" for folder in passes.folders() for f in (passes / folder).files())


def _coordinator_removes_passes(job: Location) -> None:
    """What a coordinator does to passes/: at its start it drops the folders of the job's tasks that are not
    open (none is, here), and it drops a task's passes once its result is out (asked here of every folder)."""
    remove_passes(job, tasks_with_passes(job))
    remove_passes(job, ["t000001", "t000002", "t000009", "holiday"])


def test_only_the_job_s_own_pass_parts_are_removed_and_every_other_file_stays(tmp_path: Path) -> None:
    job = Location.of(tmp_path / "job")
    _own_and_foreign_passes(job)
    assert tasks_with_passes(job) == ["t000001", "t000002"]  # holiday and t000009 are no task of the job
    assert f"t000001/{UNFINISHED}" in _files_in_passes(job) and len(list_parts(job / "passes" / "t000001")) == 1
    _coordinator_removes_passes(job)
    assert _files_in_passes(job) == sorted(f"{folder}/{name}" for folder, name in FOREIGN)
    (tmp_path / "job" / "passes" / "t000001" / "notes.txt").unlink()
    write_passes(job, "t000001", [kept_pass("t000001", "k2")])
    remove_passes(job, ["t000001"])
    assert not (tmp_path / "job" / "passes" / "t000001").exists()  # a folder left empty goes with its parts


def test_on_s3_only_the_job_s_own_pass_parts_are_removed_too(s3: str) -> None:
    job = Location.of(f"{s3}/jobs/own-passes")
    _own_and_foreign_passes(job)
    assert tasks_with_passes(job) == ["t000001", "t000002"]
    assert f"t000001/{UNFINISHED}" in _files_in_passes(job)
    _coordinator_removes_passes(job)
    assert _files_in_passes(job) == sorted(f"{folder}/{name}" for folder, name in FOREIGN)


def _claims(job: Path) -> list[dict]:
    """job.log's `pass_kept` and `task_done` lines so far (a line cut by a kill is left out)."""
    claims = []
    for line in (job / "job.log").read_text().splitlines() if (job / "job.log").exists() else []:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry["event"] in ("pass_kept", "task_done"):
            claims.append(entry)
    return claims


def test_what_job_log_calls_kept_or_done_is_on_disk_when_the_coordinator_is_killed_right_after(
        ray_address, tmp_path):
    """kill -9 of the coordinator the moment job.log says a pass was kept and a document done: every pass
    and document job.log named is in the job folder. Events are buffered for ten minutes here
    (`checkpoint.flush_every` 1000, `flush_interval_s` 600), so only what is written as it is kept is there."""
    job = tmp_path / "job"
    hang = json.dumps([{"doc": "lgpl-2.1", "fault": "hang"}])  # once its chunks are kept: half done at the kill
    buffered = ["--set", "checkpoint.flush_every=1000", "--set", "checkpoint.flush_interval_s=600"]
    proc = start_submit(license_manifest(tmp_path, LONG_DOCS), job, ray_address, *SHORT_CONTEXT[:4],
                        *buffered, env={FAULTS_ENV: hang})

    def a_pass_kept_and_a_document_done() -> bool:
        claims = _claims(job)
        return (any(c["event"] == "pass_kept" and c["doc_id"] == "lgpl-2.1" for c in claims)
                and any(c["event"] == "task_done" for c in claims))

    reached = wait_for(a_pass_kept_and_a_document_done, proc, poll=0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached, "the batch ended before the kill"
    claims = _claims(job)  # every line written before the kill
    state = load_state(job)
    said_done = {c["task_id"] for c in claims if c["event"] == "task_done"}
    assert said_done <= state.done_task_ids, f"said done, no result row: {said_done - state.done_task_ids}"
    on_disk = {(row["task_id"], row["level"], row["index"])
               for task_id in tasks_with_passes(job) for row in read_passes(job, task_id)}
    lost = [(c["doc_id"], c["level"], c["index"]) for c in claims if c["event"] == "pass_kept"
            and c["task_id"] not in state.done_task_ids and (c["task_id"], c["level"], c["index"]) not in on_disk]
    assert not lost, f"said kept, not in the job folder: {lost}"
    assert any(c["event"] == "pass_kept" and c["task_id"] not in state.done_task_ids for c in claims)


class CountingTokenizer:
    """The worker's tokenizer, counting what it is asked to tokenise (encoding and chat templates)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.encoded: list[str] = []

    def __call__(self, text, *args, **kwargs):
        self.encoded.append(text)
        return self._tokenizer(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.encoded.append(messages[0]["content"])
        return self._tokenizer.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_long_document_is_tokenised_once_by_its_plan_and_its_passes_tokenise_nothing(tmp_path):
    from runner.engine.worker import SummaryWorker

    config = load_config(TINY_CONFIG, ["summarize.context_tokens=512", "summarize.min_context_tokens=256"])
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), threads=1)
    counting = worker.summarizer.tokenizer = CountingTokenizer(worker.summarizer.tokenizer)
    text = LONG.read_text()
    task = Task("t00000001", "gpl-2", "text", text, len(text), len(text.encode()), "", {}, {})
    try:
        plan = worker.plan(task, 512)["plan"]
        assert len(plan.specs) > 3 and sum(t == text for t in counting.encoded) == 1  # the document, once
        planned = len(counting.encoded)
        assert planned == 1 + 1 + len(plan.specs)  # the document, the bare prompt's size, each chunk's prompt
        rows = [worker.run_pass(spec, 1)["row"] for spec in plan.specs]
        assert len(counting.encoded) == planned  # a pass runs the prompt its spec carries
        merge = worker.plan_merge(task, 1, [row["text"] for row in rows], 512)["plan"]
        assert not any(text in t for t in counting.encoded[planned:])  # merges tokenise summaries only
        assert merge.specs and all(spec.level == 1 and spec.context_tokens == 512 for spec in merge.specs)
    finally:
        worker.engine.close()


def test_each_level_of_a_long_document_is_planned_once_and_each_pass_dealt_once(uninterrupted_job):
    """The context crosses Ray once per level (the plan call out, its specs back); a pass is dealt once."""
    log = [json.loads(line) for line in (uninterrupted_job / "job.log").read_text().splitlines()]
    rows = rows_by_doc(uninterrupted_job)
    for doc_id, row in rows.items():
        planned = [(e["level"], e["context_tokens"]) for e in log
                   if e["event"] == "level_planned" and e["doc_id"] == doc_id]
        levels = {e["level"] for e in log if e["event"] == "pass_kept" and e["doc_id"] == doc_id}
        assert sorted(planned) == [(level, 512) for level in sorted(levels)], doc_id
        dealt = [(e["level"], e["index"]) for e in log if e["event"] == "pass_assigned" and e["doc_id"] == doc_id]
        assert len(dealt) == len(set(dealt)) == row["passes"], doc_id
