"""Balanced workers: a task's expected work (its passes' prefill and decode), the longest-first,
least-loaded rule on its own, in the coordinator's queue with real threads, and through the CLI."""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.balance import expected_work, may_take, merge_work, pass_counts
from jobs.config import load_config
from jobs.kvplan import CHARS_PER_TOKEN
from jobs.outcome import DealtPass
from jobs.task import Task
from runner.coordinator import PassRun, TaskQueue, TaskRun, work_of
from tests.helpers.cli import LICENSES, TINY_CONFIG, export_rows, kvbatch, write_jsonl

CONFIG = load_config(TINY_CONFIG)


def _task(doc_id: str, n_chars: int, **overrides: int) -> Task:
    return Task(task_id=doc_id, doc_id=doc_id, source_type="text", source="", n_chars=n_chars, n_bytes=n_chars,
                sha256="", overrides=overrides, meta={})


# -- the estimate -----------------------------------------------------------------------------------
def test_a_document_that_fits_one_pass_is_its_prompt_plus_its_weighted_answer():
    short, longer = expected_work(_task("a", 300), CONFIG), expected_work(_task("b", 600), CONFIG)
    assert len(pass_counts(200, 1024, 16, 16)) == 1
    assert longer - short == 100  # 300 more characters are 100 more prompt tokens to prefill, same decode


def test_a_longer_answer_is_more_work():
    assert expected_work(_task("a", 300, max_new_tokens=64), CONFIG) > expected_work(_task("a", 300), CONFIG)


def test_a_map_reduced_document_counts_every_chunk_and_merge_pass():
    # 10,000 tokens in chunks of 944 (1024 less prompt and answer) overlapping by 16: 11 chunks, then
    # one pass merging their 11 summaries of 16 tokens, a separator token between two
    assert pass_counts(10_000, 1024, 16, 16) == [944] * 11 + [11 * 16 + 10]
    # 60 summaries, 55 to a merge pass (55 x 16 + 54 separators fit 944): two rounds
    assert pass_counts(60 * 928 + 16, 1024, 16, 16) == [944] * 60 + [55 * 16 + 54, 5 * 16 + 4] + [2 * 16 + 1]
    assert expected_work(_task("long", 30_000), CONFIG) > 10 * expected_work(_task("one", 2_800), CONFIG)


def test_a_shorter_context_is_more_passes_and_more_work():
    task = _task("long", 30_000)
    assert expected_work(task, CONFIG, 512) > expected_work(task, CONFIG, 1024)
    assert expected_work(task, CONFIG) == expected_work(task, CONFIG, CONFIG.summarize.context_tokens)
    assert expected_work(_task("x", 100 * CHARS_PER_TOKEN), CONFIG) > 0


# -- the rule ---------------------------------------------------------------------------------------
def _assign(works: list[float], workers: int, asking: list[int]) -> dict[int, list[int]]:
    """Every worker free at once, asking in the order `asking` cycles through: the rule deals the
    tasks, longest first, as the coordinator's queue does."""
    loads = dict.fromkeys(range(workers), 0.0)
    got: dict[int, list[int]] = {w: [] for w in range(workers)}
    order = sorted(range(len(works)), key=lambda i: -works[i])
    turn = 0
    for i in order:
        takers = [w for w in asking if may_take(w, loads, list(range(workers)))]
        assert takers, "no worker may take the next task: the queue would hang"
        w = takers[turn % len(takers)]
        turn += 1
        got[w].append(i)
        loads[w] += works[i]
    return got


@given(st.lists(st.floats(1, 1e6), min_size=1, max_size=60), st.integers(1, 6), st.randoms())
@settings(max_examples=200, deadline=None)
def test_every_task_goes_to_one_worker_and_no_worker_is_more_than_one_task_over_the_mean(works, workers, rnd):
    asking = list(range(workers))
    rnd.shuffle(asking)
    got = _assign(works, workers, asking)
    assert sorted(i for tasks in got.values() for i in tasks) == list(range(len(works)))
    loads = [sum(works[i] for i in tasks) for tasks in got.values()]
    mean = sum(works) / workers
    assert max(loads) <= mean + max(works) + 1e-6 * sum(works)


def test_a_busy_or_down_worker_does_not_hold_the_task_back():
    loads = {"a": 10.0, "b": 1.0}
    assert not may_take("a", loads, ["a", "b"])
    assert may_take("a", loads, ["a"])  # b has no free slot (or is down)
    assert may_take("b", loads, ["a", "b"])


# -- the coordinator's queue, real threads ----------------------------------------------------------
def _queue(sizes: dict[str, int], down: set[str] = frozenset(), slots: int = 2) -> TaskQueue:
    runs = [TaskRun(task=_task(doc, n), context_tokens=1024) for doc, n in sizes.items()]
    return TaskQueue(runs, lambda item: work_of(item, CONFIG), ["w0", "w1"], slots, lambda w: w in down)


def _take_soon(queue: TaskQueue, worker: str, held: ExitStack, wait_s: float = 0.5) -> TaskRun | None:
    """What `taking` gives within `wait_s` (None when it is still waiting then), held until `held` closes."""
    stop = threading.Event()
    timer = threading.Timer(wait_s, stop.set)
    timer.start()
    try:
        return held.enter_context(queue.taking(worker, stop))
    finally:
        timer.cancel()


def test_the_queue_deals_the_longest_to_the_least_loaded_worker():
    queue = _queue({"huge": 30_000, "mid1": 15_000, "mid2": 14_000, "tiny": 300})
    with ExitStack() as held:
        assert _take_soon(queue, "w0", held).task.doc_id == "huge"
        assert _take_soon(queue, "w1", held).task.doc_id == "mid1"
        started = time.monotonic()
        assert _take_soon(queue, "w0", held, wait_s=0.3) is None  # w1, with a free slot, has less work in flight
        assert time.monotonic() - started >= 0.3
        assert _take_soon(queue, "w1", held).task.doc_id == "mid2"
        assert _take_soon(queue, "w0", held).task.doc_id == "tiny"  # w1's slots are full now


def test_a_down_worker_does_not_hold_the_queue_back():
    queue = _queue({"huge": 30_000, "mid": 15_000}, down={"w1"})
    with ExitStack() as held:
        assert _take_soon(queue, "w0", held).task.doc_id == "huge"
        assert _take_soon(queue, "w0", held).task.doc_id == "mid"


def test_a_task_handed_back_at_a_shorter_context_goes_first_with_its_new_work():
    queue = _queue({"huge": 30_000, "mid": 15_000}, slots=1)
    with ExitStack() as held:
        huge = _take_soon(queue, "w0", held)
        before = queue.load("w0")
        huge.context_tokens = 512
        assert queue.load("w0") > before  # the work in flight follows the task's context
        queue.hand_back("w0", huge)
        assert queue.load("w0") == 0
        with ExitStack() as on_w1:
            assert _take_soon(queue, "w1", on_w1) is huge
        assert queue.load("w1") == 0  # its block ended: w1 no longer holds it
        assert _take_soon(queue, "w1", held).task.doc_id == "mid"
        assert not queue.drained()
    assert queue.drained()  # w0's block ending after its hand-back released nothing twice


def test_a_task_is_held_while_its_block_runs_and_released_however_the_block_ends():
    queue = _queue({"huge": 30_000}, slots=1)
    with pytest.raises(RuntimeError, match="a bug in the task loop"), ExitStack() as held:
        run = _take_soon(queue, "w0", held)
        assert queue.load("w0") == expected_work(run.task, CONFIG, run.context_tokens) > 0 and not queue.drained()
        raise RuntimeError("a bug in the task loop")
    assert queue.load("w0") == 0 and queue.drained()
    with ExitStack() as held:
        assert _take_soon(queue, "w1", held) is None  # nothing left and nothing in flight


def test_a_task_dealt_out_waits_for_its_passes_then_goes_first():
    queue = _queue({"huge": 30_000, "mid": 15_000})
    passes = [DealtPass(i, f"key-{i}", [1] * 900) for i in range(3)]
    with ExitStack() as held:
        huge = _take_soon(queue, "w0", held)
        huge.dealt_at = huge.context_tokens
        whole = queue.load("w0")
        assert queue.room("w0") == 1
        queue.deal("w0", huge, passes, 4)  # one of its 4 chunks was kept before
        assert queue.load("w0") == 0 and queue.left() == 2  # its passes count as the task's, once
        on_w0, on_w1 = ExitStack(), ExitStack()
        first = _take_soon(queue, "w0", on_w0)
        second = _take_soon(queue, "w1", on_w1)  # the other worker, while the first pass runs
        assert isinstance(first, PassRun) and isinstance(second, PassRun) and first.run is second.run is huge
        third = _take_soon(queue, "w1", on_w1)
        assert isinstance(third, PassRun) and {p.dealt.index for p in (first, second, third)} == {0, 1, 2}
        on_w0.close()
        on_w1.close()  # its last pass ended: the task is back, in front of the longest task left
        assert _take_soon(queue, "w0", held) is huge
        merges = merge_work(huge.task, CONFIG, 4, huge.context_tokens)
        assert queue.load("w0") == merges and 0 < merges < whole / 4  # what is left of it: its merges
        assert _take_soon(queue, "w1", held).task.doc_id == "mid"
    assert queue.drained()


# -- through the CLI --------------------------------------------------------------------------------
LONG = {"gpl-3": "GPL-3", "gpl-2": "GPL-2", "mpl-2.0": "MPL-2.0"}
SHORT = {"short-1": "A short note on licensing. " * 20, "short-2": "Another short document. " * 25}


def test_a_long_documents_chunks_run_on_both_workers_from_the_start(ray_address, tmp_path):
    """The coordinator deals each document's chunks out as passes of their own, the longest document's
    first: its chunks run on both workers at once, each is kept once, and the summaries are token for
    token those of one worker running each document alone."""
    settings = ("--set", "workers.count=2", "--set", "batch.max_sequences=2")
    rows = [{"id": doc, "path": str(LICENSES / file)} for doc, file in LONG.items()]
    rows += [{"id": doc, "text": text} for doc, text in SHORT.items()]
    manifest = write_jsonl(tmp_path / "manifest.jsonl", rows)
    results, logs = {}, {}
    for name, extra in (("dealt", settings), ("alone", ("--set", "workers.count=1", "--set", "batch.max_sequences=1")),
                        ("roomy", ("--set", "workers.count=2", "--set", "batch.max_sequences=16"))):
        job = tmp_path / name
        kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address, *extra,
                check=0)
        results[name] = {r["doc_id"]: r for r in export_rows(job)}
        logs[name] = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    dealt, log = results["dealt"], logs["dealt"]
    assert {doc: r["status"] for doc, r in dealt.items()} == dict.fromkeys([*LONG, *SHORT], "done")
    assert {doc: r["summary"] for doc, r in dealt.items()} == {doc: r["summary"] for doc, r in results["alone"].items()}

    deals = [e for e in log if e["event"] == "task_dealt"]
    assert sorted(e["doc_id"] for e in deals) == sorted(LONG)  # the shorts fit one pass
    assert all(e["dealt"] == e["chunks"] == dealt[e["doc_id"]]["chunks"] > 2 for e in deals)
    kept = [e for e in log if e["event"] == "pass_kept"]
    places = [(e["doc_id"], e["level"], e["index"]) for e in kept]
    assert len(places) == len(set(places)) == sum(r["passes"] for r in dealt.values())  # each pass kept once
    workers = {r["worker"] for r in dealt.values()}
    assert len(workers) == 2
    taken = [(e["doc_id"], e["index"], e["worker"]) for e in log if e["event"] == "pass_assigned"]
    assert sorted(place[:2] for place in taken) == sorted((e["doc_id"], i) for e in deals for i in range(e["dealt"]))
    assert len({slot for doc, _, slot in taken if doc == "gpl-3"}) == 2, taken  # each dealt pass taken once, by a slot
    assert {e["worker"] for e in kept if e["doc_id"] == "gpl-3" and e["level"] == 0} == workers  # its chunks on both
    # dealt the moment a worker first took it, and its own attempt (the merges) only once every chunk was kept
    steps = [e for e in log
             if e.get("doc_id") == "gpl-3" and e["event"] in ("task_dealt", "task_assigned", "pass_kept")]
    assert steps[0]["event"] == "task_dealt", steps[:2]
    merges = next(i for i, e in enumerate(steps) if e["event"] == "task_assigned")
    assert all(e["event"] == "pass_kept" and e["level"] == 0 for e in steps[1:merges])
    assert merges == 1 + dealt["gpl-3"]["chunks"], steps
    # every pass the task ran counts as its own: none reused, and its timings include the dealt ones
    assert all(r["passes_reused"] == 0 and r["prefill_s"] > 0 for r in dealt.values())
    # each kept pass says what it took on the worker that ran it, so a timeline can place every pass
    # there; a document's passes add up to its row
    for doc, row in dealt.items():
        own = [e for e in kept if e["doc_id"] == doc]
        assert all(e["prefill_s"] > 0 and e["decode_s"] >= 0 and e["new_tokens"] > 0 for e in own), own
        assert sum(e["prefill_s"] for e in own) == pytest.approx(row["prefill_s"]), doc
        assert sum(e["decode_s"] for e in own) == pytest.approx(row["decode_s"]), doc
    # with a slot free for each of its chunks, a document's worker decodes them side by side: none is dealt
    roomy = results["roomy"]
    assert max(roomy[doc]["chunks"] for doc in LONG) <= 16 and {r["summary"] for r in roomy.values()} == {
        r["summary"] for r in dealt.values()}
    assert [e["event"] for e in logs["roomy"] if e["event"] in ("task_dealt", "pass_assigned")] == []
