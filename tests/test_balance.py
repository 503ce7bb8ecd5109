"""Balanced workers: a task's expected work (its passes' prefill and decode), the longest-first,
least-loaded rule on its own, in the work queue with real threads, and through the CLI."""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.balance import WorkQueue, expected_passes, expected_work, may_take, pass_counts
from jobs.config import load_config
from jobs.kvplan import CHARS_PER_TOKEN
from jobs.task import Task
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
    assert len(expected_passes(task, CONFIG, 512)) > len(expected_passes(task, CONFIG, 1024))
    assert expected_work(task, CONFIG) == expected_work(task, CONFIG, CONFIG.summarize.context_tokens)
    assert expected_work(_task("x", 100 * CHARS_PER_TOKEN), CONFIG) > 0


# -- the rule ---------------------------------------------------------------------------------------
def _assign(works: list[float], workers: int, asking: list[int]) -> dict[int, list[int]]:
    """Every worker free at once, asking in the order `asking` cycles through: the rule deals the
    tasks, longest first, as the work queue does."""
    loads = dict.fromkeys(range(workers), 0.0)
    got: dict[int, list[int]] = {w: [] for w in range(workers)}
    order = sorted(range(len(works)), key=lambda i: -works[i])
    for turn, i in enumerate(order):
        takers = [w for w in asking if may_take(w, loads, list(range(workers)))]
        assert takers, "no worker may take the next task: the queue would hang"
        w = takers[turn % len(takers)]
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


# -- the work queue, real threads -------------------------------------------------------------------
@dataclass(eq=False)
class _Item:
    """A work item as the queue sees one (runner's `Planning` or `Pass`): its document and expected work."""

    doc: str
    work: float


def _queue(later: list[_Item], slots: int = 2) -> WorkQueue:
    return WorkQueue(later, ["w0", "w1"], slots, lambda w: False)


def _take(queue: WorkQueue, worker: str, held: ExitStack) -> _Item | None:
    """What `taking` gives `worker`, held until `held` closes; it must come at once (a take that waits
    instead gives None after 5 s, and the test's assertion fails rather than hangs)."""
    stop = threading.Event()
    timer = threading.Timer(5.0, stop.set)
    timer.start()
    try:
        return held.enter_context(queue.taking(worker, stop))
    finally:
        timer.cancel()


class _Taker:
    """A worker's feeding thread taking one item (or None) and holding it until `release` is set, each step
    written to `order`, so a test shows what came before what without sleeping."""

    def __init__(self, queue: WorkQueue, worker: str, order: list[str]) -> None:
        self.queue, self.worker, self.order = queue, worker, order
        self.asking, self.took, self.release, self.stop = (threading.Event() for _ in range(4))
        self.item: _Item | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.asking.set()
        with self.queue.taking(self.worker, self.stop) as item:
            self.item = item
            self.order.append(f"{self.worker} takes {item.doc if item else None}")
            self.took.set()
            self.release.wait(10)

    def end(self) -> None:
        self.stop.set()
        self.release.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_the_queue_gives_the_longest_to_the_least_loaded_worker():
    queue = _queue([_Item("tiny", 300), _Item("mid2", 14_000), _Item("huge", 30_000), _Item("mid1", 15_000)])
    order: list[str] = []
    with ExitStack() as held:
        assert _take(queue, "w0", held).doc == "huge"
        assert _take(queue, "w1", held).doc == "mid1"
        w0 = _Taker(queue, "w0", order)  # w1, with a free slot, has less work in flight: w0 waits
        held.callback(w0.end)
        assert w0.asking.wait(5)
        order.append("w1 takes mid2")
        assert _take(queue, "w1", held).doc == "mid2"  # w1 may: its 15,000 are less than w0's 30,000
        assert w0.took.wait(5)  # w1's slots are full now: it no longer holds w0 back
        assert order == ["w1 takes mid2", "w0 takes tiny"]
        assert queue.load("w0") == 30_300 and queue.load("w1") == 29_000


def test_a_down_worker_does_not_hold_the_queue_back():
    down = {"w1"}
    queue = WorkQueue([_Item("huge", 30_000), _Item("mid", 15_000), _Item("tiny", 300)], ["w0", "w1"], 2,
                      lambda w: w in down)
    with ExitStack() as held:
        assert _take(queue, "w0", held).doc == "huge"
        assert _take(queue, "w0", held).doc == "mid"  # w1 holds nothing, but it is down
        down.clear()  # back: asked at every take
        assert _take(queue, "w1", held).doc == "tiny"


def test_a_take_gives_none_once_the_batch_stops_while_it_waits():
    queue = _queue([_Item("huge", 30_000), _Item("mid", 15_000)])
    order: list[str] = []
    with ExitStack() as held:
        assert _take(queue, "w0", held).doc == "huge"
        w0 = _Taker(queue, "w0", order)  # waits: w1 has a free slot and nothing in flight
        assert w0.asking.wait(5)
        order.append("stop")
        w0.stop.set()
        assert w0.took.wait(5)
        w0.end()
        assert order == ["stop", "w0 takes None"] and queue.left() == 1


def test_items_put_go_in_front_of_the_documents_not_planned_yet():
    queue = _queue([_Item("huge", 30_000), _Item("mid", 15_000)], slots=4)
    with ExitStack() as held:
        huge = _take(queue, "w0", held)
        assert huge.doc == "huge"
        queue.put([_Item("huge", 500), _Item("huge", 900)])  # its passes, once it is planned
        assert [_take(queue, "w1", held).work for _ in range(2)] == [900, 500]  # the longest of them first
        assert _take(queue, "w1", held).doc == "mid"  # only then the documents that wait
        queue.put([_Item("mid", 200)])
        assert _take(queue, "w1", held).work == 200


def test_an_item_is_held_while_its_block_runs_and_released_however_the_block_ends():
    queue = _queue([_Item("huge", 30_000)], slots=1)
    with pytest.raises(RuntimeError, match="a bug in the feeding loop"), ExitStack() as held:
        item = _take(queue, "w0", held)
        assert queue.load("w0") == item.work == 30_000 and not queue.drained()
        raise RuntimeError("a bug in the feeding loop")
    assert queue.load("w0") == 0 and queue.drained()
    with ExitStack() as held:
        assert _take(queue, "w1", held) is None  # at once: nothing left and nothing in flight


def test_a_take_waits_while_another_worker_holds_an_item_that_may_bring_more():
    queue = _queue([_Item("doc", 5_000)], slots=1)
    order: list[str] = []
    first = second = None
    try:
        with ExitStack() as held:
            planning = _take(queue, "w0", held)  # the document's planning: nothing else is left
            assert planning.doc == "doc" and queue.left() == 0 and not queue.drained()
            first = _Taker(queue, "w1", order)  # waits for what w0's planning brings
            assert first.asking.wait(5)
            order.append("w0 puts a pass")
            queue.put([_Item("doc", 900)])  # the plan's passes
            assert first.took.wait(5) and first.item.work == 900
            first.release.set()
            first.thread.join(5)
            second = _Taker(queue, "w1", order)  # its pass ended, w0 still holds the planning: w1 waits
            assert second.asking.wait(5)
            order.append("w0's block ends")
        assert second.took.wait(5)  # only now is nothing left and nothing in flight
    finally:
        for taker in (first, second):
            if taker is not None:
                taker.end()
    assert order == ["w0 puts a pass", "w1 takes doc", "w0's block ends", "w1 takes None"]
    assert queue.drained()


def test_a_worker_takes_its_own_documents_next_pass_before_a_larger_one_among_the_first_slots():
    queue = _queue([_Item("E", 100), _Item("D", 50)], slots=2)
    with ExitStack() as held:
        assert _take(queue, "w1", held).doc == "E"
        assert _take(queue, "w0", held).doc == "D"  # w0 holds D's planning (less work than w1's E)
        e40, d5 = _Item("E", 40), _Item("D", 5)
        queue.put([e40, d5])
        with ExitStack() as step:
            assert _take(queue, "w0", step) is d5  # D's: among the first 2, before E's larger pass
        e30, d4 = _Item("E", 30), _Item("D", 4)
        queue.put([e30, d4])  # in front now: e40, e30, d4
        with ExitStack() as step:
            assert _take(queue, "w0", step) is e40  # D's pass is not among the first 2: the first goes
        with ExitStack() as step:
            assert _take(queue, "w0", step) is d4  # e30, d4 are the first 2 now
        assert queue.left() == 1


def test_left_counts_each_document_once_and_drained_waits_for_the_items_in_flight():
    queue = _queue([_Item("A", 10), _Item("B", 20)], slots=8)
    assert queue.left() == 2 and not queue.drained()
    with ExitStack() as held:
        assert _take(queue, "w0", held).doc == "B"
        assert queue.left() == 1 and not queue.drained()  # B is planned, A waits
        queue.put([_Item("B", 5), _Item("B", 6), _Item("B", 7)])
        assert queue.left() == 2  # B once, however many of its passes wait
        queue.put([_Item("A", 1)])
        assert queue.left() == 2  # A once, in front and waiting to be planned
        for _ in range(5):
            _take(queue, "w1", held)
        assert queue.left() == 0 and not queue.drained()  # nothing waits, but 6 items are in flight
    assert queue.drained()


def test_an_item_put_back_by_a_lost_worker_goes_to_another_worker_and_is_released_once():
    queue = _queue([_Item("huge", 30_000), _Item("mid", 15_000)], slots=1)
    with ExitStack() as on_w0:
        huge = _take(queue, "w0", on_w0)
        queue.put([huge])  # its worker was lost: in front, for any worker, while w0's block still runs
        assert queue.left() == 2
        with ExitStack() as on_w1:
            assert _take(queue, "w1", on_w1) is huge
            on_w0.close()  # w0's block ends after the put: it releases its own hold, not w1's
            assert queue.load("w1") == 30_000 and queue.load("w0") == 0
        assert queue.load("w1") == 0
        assert _take(queue, "w0", on_w0).doc == "mid"
        assert not queue.drained()
    assert queue.drained()


# -- through the CLI --------------------------------------------------------------------------------
LONG = {"gpl-3": "GPL-3", "gpl-2": "GPL-2", "mpl-2.0": "MPL-2.0"}
SHORT = {"short-1": "A short note on licensing. " * 20, "short-2": "Another short document. " * 25}


def _events(log: list[dict], event: str, **fields: object) -> list[dict]:
    return [e for e in log if e["event"] == event and all(e.get(k) == v for k, v in fields.items())]


def _every_pass_assigned_once_and_kept_where_it_ran(log: list[dict], rows: dict[str, dict]) -> None:
    """Each pass goes through the queue once (no worker was lost) and is kept once, by the worker of the
    slot it was assigned to; a merge level is assigned only once every pass of the level before was kept."""
    assigned, kept = _events(log, "pass_assigned"), _events(log, "pass_kept")
    places = [(e["doc_id"], e["level"], e["index"]) for e in kept]
    assert len(places) == len(set(places)) == sum(r["passes"] for r in rows.values())  # each pass kept once
    assert sorted((e["doc_id"], e["level"], e["index"]) for e in assigned) == sorted(places)
    host_of = {e["slot"]: e["worker"] for e in _events(log, "worker_ready")}
    slot_of = {(e["doc_id"], e["level"], e["index"]): e["worker"] for e in assigned}
    assert all(e["worker"] == host_of[slot_of[e["doc_id"], e["level"], e["index"]]] for e in kept)
    for doc in rows:
        lines = [(i, e) for i, e in enumerate(log) if e.get("doc_id") == doc]
        for level in range(1, 1 + max(e["level"] for e in kept if e["doc_id"] == doc)):
            first_merge = min(i for i, e in lines if e["event"] == "pass_assigned" and e["level"] == level)
            below = [i for i, e in lines if e["event"] == "pass_kept" and e["level"] == level - 1]
            assert below and max(below) < first_merge, (doc, level)


def test_a_long_documents_chunks_run_on_both_workers_from_the_start(ray_address, tmp_path):
    """Every pass goes through the queue, the longest document first: with two workers free when it is
    planned, its chunks start on both at once; its merges only once every chunk was kept; each pass is
    kept once, and the summaries are token for token those of one worker running each document alone."""
    two = ("--set", "workers.count=2", "--set", "batch.max_sequences=2")
    rows = [{"id": doc, "path": str(LICENSES / file)} for doc, file in LONG.items()]
    rows += [{"id": doc, "text": text} for doc, text in SHORT.items()]
    results, logs = {}, {}
    for name, manifest_rows, extra in (
            ("shared", rows, two), ("alone", rows, ("--set", "workers.count=1", "--set", "batch.max_sequences=1")),
            ("roomy", rows, ("--set", "workers.count=2", "--set", "batch.max_sequences=16")),
            # the longest document and a short one: the short one's worker is free when the long one's
            # chunks come, so they start on both workers
            ("pair", [rows[0], rows[len(LONG)]], two)):
        job = tmp_path / name
        manifest = write_jsonl(tmp_path / f"{name}.jsonl", manifest_rows)
        kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address, *extra,
                check=0)
        results[name] = {r["doc_id"]: r for r in export_rows(job)}
        logs[name] = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    alone = {doc: r["summary"] for doc, r in results["alone"].items()}
    for name, rows_of in results.items():
        assert {doc: r["status"] for doc, r in rows_of.items()} == dict.fromkeys(rows_of, "done"), name
        assert {doc: r["summary"] for doc, r in rows_of.items()} == {doc: alone[doc] for doc in rows_of}, name
        _every_pass_assigned_once_and_kept_where_it_ran(logs[name], rows_of)
    shared, log = results["shared"], logs["shared"]
    assert set(shared) == {*LONG, *SHORT} and all(shared[doc]["chunks"] > 2 for doc in LONG)
    assert all(shared[doc]["chunks"] == 1 for doc in SHORT)  # the shorts fit one pass

    # the longest two documents are planned first, one on each worker, each the first work of its worker
    for name in ("shared", "roomy"):
        planned = {e["doc_id"]: e for e in _events(logs[name], "task_assigned")}
        assert set(planned) == set(results[name])  # each document planned once (its first level)
        assert all(e["worker_work"] >= e["expected_work"] > 0 for e in planned.values())  # its own work counts
        assert planned["gpl-3"]["worker"] != planned["gpl-2"]["worker"], name
        assert all(planned[doc]["worker_work"] == planned[doc]["expected_work"] for doc in ("gpl-3", "gpl-2")), name
    assert {e["worker"] for e in _events(log, "pass_kept")} == {e["worker"] for e in _events(log, "worker_ready")}

    # two workers free when the long document is planned: its chunks run on both from the start, before
    # any of them is kept (its planner's worker holds the planning's work while the passes come, so the
    # other worker takes the first ones, and the planner's once the other's slots are full)
    pair = logs["pair"]
    assert len(_events(pair, "worker_ready")) == 2
    steps = [e for e in pair if e.get("doc_id") == "gpl-3" and e["event"] in ("pass_assigned", "pass_kept")
             and e["level"] == 0]
    first_kept = next(i for i, e in enumerate(steps) if e["event"] == "pass_kept")
    slots = {e["slot"] for e in _events(pair, "worker_ready")}
    assert {e["worker"] for e in steps[:first_kept]} == slots, steps
    assert len(steps) == 2 * results["pair"]["gpl-3"]["chunks"]

    # every pass the task ran counts as its own: none reused, and its timings include every pass's
    assert all(r["passes_reused"] == 0 and r["prefill_s"] > 0 for r in shared.values())
    # each kept pass says what it took on the worker that ran it, so a timeline can place every pass
    # there; a document's passes add up to its row
    kept = _events(log, "pass_kept")
    for doc, row in shared.items():
        own = [e for e in kept if e["doc_id"] == doc]
        assert all(e["prefill_s"] > 0 and e["decode_s"] >= 0 and e["new_tokens"] > 0 for e in own), own
        assert sum(e["prefill_s"] for e in own) == pytest.approx(row["prefill_s"]), doc
        assert sum(e["decode_s"] for e in own) == pytest.approx(row["decode_s"]), doc
    # with a slot free for each of its chunks, every pass still goes through the queue (none runs inside
    # another's call), and the summaries are the same
    roomy = results["roomy"]
    assert max(roomy[doc]["chunks"] for doc in LONG) <= 16
    assert len(_events(logs["roomy"], "pass_assigned")) == sum(r["passes"] for r in roomy.values())
