"""A long document's finished passes are checkpointed (storage/passes.py) and reused by every later
attempt at it: a resume after kill -9, a transient retry, a move down the cache ladder; the summaries
stay token for token those of an uninterrupted run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from jobs.config import JobConfig
from jobs.schema import PASS_SCHEMA
from jobs.stopping import StopReason
from runner.engine.generation import Generation
from runner.engine.pass_book import PassBook, settings_fingerprint
from storage.checkpoint import load_state
from storage.parts import read_parts
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, license_manifest, start_submit, wait_for

#: five long licence texts: 4 to 17 chunks each at a 512-token context, a merge round or two above them
LONG_DOCS = ["LGPL-2.1", "GPL-2", "MPL-2.0", "Apache-2.0", "Artistic"]
#: spreading off: each count below is of one worker's own reuse, which the passes a helping worker
#: ran would add to (tests/test_pass_spreading.py)
SHORT_CONTEXT = ["--set", "summarize.context_tokens=512", "--set", "summarize.min_context_tokens=256",
                 "--set", "checkpoint.flush_every=1", "--set", "batch.spread_passes=false"]


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


def rows_by_doc(job: Path) -> dict[str, dict]:
    return {row["doc_id"]: row for row in export_rows(job)}


@pytest.fixture(scope="module")
def uninterrupted(ray_address, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    kvbatch("submit", str(license_manifest(tmp, LONG_DOCS)), "-c", str(TINY_CONFIG), "-j", str(tmp / "job"),
            "--address", ray_address, *SHORT_CONTEXT, check=0)
    rows = rows_by_doc(tmp / "job")
    assert all(row["passes"] > row["chunks"] > 3 for row in rows.values()), rows  # chunks and merges
    assert not (tmp / "job" / "passes").exists() or not any((tmp / "job" / "passes").iterdir())
    return rows


def test_a_kill_at_seventy_percent_then_resume_redoes_no_finished_pass(uninterrupted, ray_address, tmp_path):
    total = sum(row["passes"] for row in uninterrupted.values())
    job = tmp_path / "job"
    proc = start_submit(license_manifest(tmp_path, LONG_DOCS), job, ray_address, *SHORT_CONTEXT)

    def seventy_percent_with_a_document_half_done() -> bool:
        if not (job / "job.json").exists():
            return False
        saved = saved_passes(job, running=True)
        state = load_state(job)  # after the passes: a folder cleaned meanwhile is of a document done by now
        finished = sum(row["passes"] for row in state.results.to_pylist())
        in_progress = {t: n for t, n in saved.items() if t not in state.done_task_ids}
        return finished + sum(in_progress.values()) >= 0.7 * total and bool(in_progress)

    reached = wait_for(seventy_percent_with_a_document_half_done, proc, poll=0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached, "the batch finished before the kill"
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


def test_a_retry_and_a_move_down_the_ladder_reuse_the_passes_already_done(uninterrupted, ray_address, tmp_path):
    # the faults strike after a rung's first level of passes (the chunks), mid-task
    faults = json.dumps([{"doc": "gpl-2", "fault": "io", "attempts": [1]},
                         {"doc": "mpl-2.0", "fault": "oom", "rungs": ["dynamic"]}])
    job = tmp_path / "job"
    kvbatch("submit", str(license_manifest(tmp_path, ["GPL-2", "MPL-2.0", "Artistic"])), "-c", str(TINY_CONFIG),
            "-j", str(job), "--address", ray_address, *SHORT_CONTEXT, "--set", "retry.backoff_initial_s=0",
            env={"KVBATCH_FAULTS": faults}, check=0)
    rows = rows_by_doc(job)
    retried, moved, plain = rows["gpl-2"], rows["mpl-2.0"], rows["artistic"]
    assert retried["attempts"] == 2 and retried["passes_reused"] == retried["chunks"]
    assert moved["attempts"] == 1 and moved["fallbacks"] and moved["cache_strategy"] != "dynamic"
    assert moved["passes_reused"] == moved["chunks"]
    assert plain["passes_reused"] == 0
    assert {d: r["summary"] for d, r in rows.items()} == {d: uninterrupted[d]["summary"] for d in rows}


def generation(tokens: list[int]) -> Generation:
    return Generation(tokens=tokens, input_tokens=3, ttft_s=0.5, decode_s=1.0, stop_reason=StopReason.EOS)


def book(job: Path, fingerprint: str, context_tokens: int = 512) -> PassBook:
    return PassBook(str(job), "t00000001", "doc", context_tokens, fingerprint, lambda t: " ".join(map(str, t)), "w")


def test_a_pass_is_found_by_what_it_was_given_whatever_the_context_and_lost_with_the_settings(tmp_path):
    fingerprint = settings_fingerprint(JobConfig(), "cpu", "torch.float32")
    first = book(tmp_path, fingerprint)
    assert first.find([1, 2, 3], 16) is None
    first.keep(0, 0, [1, 2, 3], 16, generation([7, 8]))
    # a shorter context's plan that gives this pass the same prompt reuses it; another prompt or limit does not
    again = book(tmp_path, fingerprint, context_tokens=256)
    found = again.find([1, 2, 3], 16)
    assert found is not None and found.tokens == [7, 8] and found.reused and found.stop_reason == StopReason.EOS
    assert again.find([1, 2, 4], 16) is None and again.find([1, 2, 3], 17) is None
    # a book open while another worker keeps a pass sees it when it looks again, not before
    again_kept = book(tmp_path, fingerprint)
    again_kept.keep(0, 1, [4, 5], 16, generation([9]))
    assert again.find([4, 5], 16) is None
    assert again.find([4, 5], 16, fresh=True).tokens == [9]
    assert first.kept == 1 and again.kept == 0
    other = settings_fingerprint(JobConfig(summarize={"seed": 1}), "cpu", "torch.float32")
    assert other != fingerprint
    assert book(tmp_path, other).find([1, 2, 3], 16) is None
    # where the KV lives, the context and the prefill chunking do not decide tokens: same fingerprint
    assert settings_fingerprint(JobConfig(cache={"strategy": "tiered-disk"}, summarize={"context_tokens": 2048}),
                                "cpu", "torch.float32") == fingerprint


@pytest.fixture
def unreachable_bucket(monkeypatch) -> str:
    """An s3:// job folder whose endpoint nobody listens on: each call to it fails after the SDK's retries."""
    from tests.helpers.system import BUCKET, free_port

    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/jobs/unseen"


def test_a_book_whose_job_folder_fails_stops_trying_it_for_the_rest_of_the_attempt(unreachable_bucket, caplog):
    """Each call to an unreachable store costs seconds on the scheduler's thread; a book that tried once
    runs its passes unkept (they only save time) instead of paying that at every pass."""
    fingerprint = settings_fingerprint(JobConfig(), "cpu", "torch.float32")
    with caplog.at_level("WARNING", logger="runner.engine.pass_book"):
        unseen = book(unreachable_bucket, fingerprint)
        for index in range(3):
            assert unseen.find([1, 2, index], 16, fresh=True) is None
            unseen.mark_started([1, 2, index], 16)
            unseen.keep(0, index, [1, 2, index], 16, generation([7]))
    [warning] = [r.getMessage() for r in caplog.records]
    assert "cannot reach the storage endpoint" in warning and "not kept" in warning, warning
    assert unseen.kept == 0


def test_a_worker_that_cannot_reach_the_job_folder_says_so_and_keeps_no_passes(unreachable_bucket, tmp_path):
    from jobs.config import load_config
    from runner.engine.worker import SummaryWorker

    config = load_config(TINY_CONFIG).model_dump(mode="json")
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), threads=1, job_dir=unreachable_bucket)
    try:
        info = worker.info()
    finally:
        worker.scheduler.close()
    assert "cannot reach the storage endpoint" in info["passes_not_kept"], info
    seen = SummaryWorker(config, "job", str(tmp_path / "kv"), threads=1, job_dir=str(tmp_path / "job"))
    seen.scheduler.close()
    assert seen.info()["passes_not_kept"] is None
