"""batch.spread_passes: once no document is left to start, an idle worker helps with a long document
another worker runs, from its far end, through the passes kept in the job folder. End to end: the real
CLI, two real Ray workers, a real long licence text, the summaries those of a run that does not
spread. In process: a real worker's scheduler running a helping and an owning attempt."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jobs.config import load_config
from runner.engine.pass_book import PassBook
from runner.engine.probes import StageMemory
from runner.engine.rung_attempt import OWNER_POLL_S, RungAttempt
from runner.engine.scheduler import PassAbandoned, TaskClock
from runner.engine.worker import SummaryWorker
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, write_jsonl

LONG = Path("/usr/share/common-licenses/GPL-2")  # 17 chunks at a 512-token context, then merges
#: two workers; passes long enough (48 tokens each, one at a time) that the owner cannot finish its
#: 17 chunks before the idle worker joins in
TWO_WORKERS = ["--set", "workers.count=2", "--set", "summarize.context_tokens=512",
               "--set", "summarize.min_context_tokens=256", "--set", "batch.max_sequences=2",
               "--set", "summarize.max_new_tokens=48", "--set", "summarize.generation.min_new_tokens=48"]


def _run(tmp_path: Path, ray_address: str, spread: bool) -> tuple[dict[str, dict], list[dict]]:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "gpl-2", "text": LONG.read_text()},
                                                  {"id": "memo", "text": "The council met and agreed the budget."}])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            *TWO_WORKERS, "--set", f"batch.spread_passes={str(spread).lower()}", check=0)
    log = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    assert not (job / "passes").exists() or not any((job / "passes").iterdir())  # cleaned either way
    return {row["doc_id"]: row for row in export_rows(job)}, log


@pytest.fixture(scope="module")
def not_spread(ray_address, tmp_path_factory) -> tuple[dict[str, dict], list[dict]]:
    return _run(tmp_path_factory.mktemp("not_spread"), ray_address, spread=False)


def test_an_idle_worker_runs_part_of_a_long_document_and_the_summary_is_the_same(not_spread, ray_address, tmp_path):
    rows, log = _run(tmp_path, ray_address, spread=True)
    alone_rows, alone_log = not_spread
    assert {d: r["summary"] for d, r in rows.items()} == {d: r["summary"] for d, r in alone_rows.items()}
    long, alone = rows["gpl-2"], alone_rows["gpl-2"]
    assert long["passes"] == alone["passes"] and long["chunks"] == alone["chunks"] > 8, long
    assert long["attempts"] == 1 and not long["fallbacks"]

    # the moment under test: the other worker ran some of its passes, and the owner took them unrun
    shared = [e for e in log if e["event"] == "passes_shared"]
    assert shared and {e["doc_id"] for e in shared} == {"gpl-2"}, shared
    owner = next(e["worker"] for e in log if e["event"] == "task_assigned" and e["doc_id"] == "gpl-2")
    assert all(e["worker"] != owner for e in shared), (owner, shared)
    helped = sum(e["passes_run"] for e in shared)
    assert 0 < long["passes_reused"] <= helped < long["passes"], (long["passes_reused"], helped)
    print(f"{long['passes']} passes; the helper ran {helped}, the owner took {long['passes_reused']} of them unrun")

    # without spreading: nobody helps, every pass runs on the owner
    assert not [e for e in alone_log if e["event"] == "passes_shared"]
    assert alone["passes_reused"] == 0


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> SummaryWorker:
    config = load_config(TINY_CONFIG, ["batch.max_sequences=2"])
    worker = SummaryWorker(config.model_dump(mode="json"), "job", str(tmp_path_factory.mktemp("kv")), threads=1)
    yield worker
    worker.scheduler.close()


def _book(worker: SummaryWorker, job: Path) -> PassBook:
    return PassBook(str(job), "t00000001", "doc", 1024, worker.fingerprint, worker.summarizer.decode, "w")


def _attempt(worker: SummaryWorker, book: PassBook, helping: threading.Event | None = None) -> RungAttempt:
    return RungAttempt("dynamic", worker.cache_kit, worker.scheduler, StageMemory(), TaskClock(), None, "doc",
                       fault=None, passes=book, shared=True, helping=helping)


def _chunks(worker: SummaryWorker, count: int) -> list[list[int]]:
    words = worker.loaded.tokenizer("the licence grants every user the right to copy " * 20)["input_ids"]
    return [words[k: k + 60] for k in range(count)]


def test_the_owner_takes_each_pass_the_helper_kept_unrun_and_the_helper_leaves_the_last_one(worker, tmp_path):
    prompts = _chunks(worker, 4)
    plain = _attempt(worker, _book(worker, tmp_path / "plain"))(prompts, 8)
    owner = _attempt(worker, _book(worker, tmp_path / "job"))  # opened before the helper keeps anything
    helper = _attempt(worker, _book(worker, tmp_path / "job"), helping=threading.Event())
    helped = helper(prompts, 8)
    steps = worker.scheduler.plan.decode_steps
    taken = owner(prompts, 8)
    assert [g.tokens for g in taken] == [g.tokens for g in helped] == [g.tokens for g in plain]
    # the moment under test: the owner found all four at the start of each pass, and ran none of them
    assert all(g.reused for g in taken) and not any(g.reused for g in helped)
    assert worker.scheduler.plan.decode_steps == steps
    with pytest.raises(PassAbandoned, match="one pass left"):  # the final merge is the owner's
        helper(prompts[:1], 8)


def test_the_helper_leaves_a_pass_the_owner_started_to_the_owner_and_takes_its_tokens(worker, tmp_path):
    prompts = _chunks(worker, 4)
    plain = _attempt(worker, _book(worker, tmp_path / "plain"))(prompts, 8)
    owner, helper_book = _book(worker, tmp_path / "job"), _book(worker, tmp_path / "job")
    for ids in prompts[:2]:  # the owner has begun the first two
        owner.mark_started(ids, 8)
    with ThreadPoolExecutor(1) as pool:
        helped = pool.submit(_attempt(worker, helper_book, helping=threading.Event()), prompts, 8)
        # the moment under test: the helper runs the two the owner had not begun, and waits for the others
        while helper_book.kept < 2:
            time.sleep(0.01)
        time.sleep(3 * OWNER_POLL_S)
        assert not helped.done() and helper_book.kept == 2
        for ids, generation in zip(prompts[:2], plain[:2]):  # the owner finishes its two
            owner.keep(0, 0, ids, 8, generation)
        got = helped.result(timeout=30)
    assert [g.tokens for g in got] == [g.tokens for g in plain]
    assert [g.reused for g in got] == [True, True, False, False] and helper_book.kept == 2


def test_a_help_no_longer_needed_ends_its_passes_waiting_ones_unstarted_running_ones_at_their_next_step(
        worker, tmp_path):
    ended = threading.Event()
    helper = _attempt(worker, _book(worker, tmp_path / "job"), helping=ended)
    started = worker.scheduler.plan.decode_steps

    def end_after_three_steps() -> None:
        while worker.scheduler.plan.decode_steps < started + 3:
            time.sleep(0.005)
        ended.set()

    threading.Thread(target=end_after_three_steps, daemon=True).start()
    with pytest.raises(PassAbandoned):
        helper(_chunks(worker, 4), 200)
    # two ran side by side and stopped within a step or two of the end; the other two never began
    assert worker.scheduler.plan.decode_steps - started < 10
    assert not worker.scheduler.plan.running and not worker.scheduler.plan.waiting
    assert not (tmp_path / "job" / "passes").exists()  # nothing unfinished was kept
