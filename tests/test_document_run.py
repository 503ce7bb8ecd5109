"""The document state machine (jobs/document_run.py) driven by a small pure fake worker: passes completed
in any order, a kill at any instant (a fresh run made from the kept rows), a fall back to a shorter
context with passes of the old one finishing late, and the machine's single steps."""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from jobs.chunking import ContextTooSmallError, group_for_merge
from jobs.document_run import DocumentRun, Stage
from jobs.passes import LevelPlan, PassRow, PassSpec, pass_key
from jobs.task import Task

FINGERPRINT = "fp"
NEW_TOKENS = 16
SEPARATOR = "|"
CHUNK, MERGE = -2, -1  # a prompt's first id: its template (chunk ids are >= 0, so no chunk is a merge)
RUNNING = (Stage.MAPPING, Stage.MERGING)


# -- the fake worker --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Doc:
    doc_id: str
    tokens: tuple[int, ...]  # the document as its tokenizer sees it


def _task(doc: Doc) -> Task:
    return Task(task_id=doc.doc_id, doc_id=doc.doc_id, source_type="text", source="", n_chars=len(doc.tokens),
                n_bytes=len(doc.tokens), sha256="", overrides={}, meta={})


def chunk_prompt(doc: Doc, index: int, context: int) -> tuple[int, ...]:
    """Chunk `index` at `context`: the same tokens (so the same key) wherever two contexts cut alike."""
    return (CHUNK, *doc.tokens[index * context:(index + 1) * context])


def merge_prompt(texts: list[str]) -> tuple[int, ...]:
    return (MERGE, *map(ord, SEPARATOR.join(texts)))


def text_of(prompt: tuple[int, ...]) -> str:
    """A pass's summary, decided by its prompt alone as greedy decoding would be: mostly 4 to 12 characters,
    sometimes 18 to 24 (a long one may fit beside no neighbour: it is carried over as it is)."""
    digest = hashlib.sha256(repr(prompt).encode()).hexdigest()
    return digest[:(18 if int(digest[-2], 16) < 3 else 4) + int(digest[-1], 16) % 7]


def key_of(prompt: tuple[int, ...]) -> str:
    return pass_key(FINGERPRINT, list(prompt), NEW_TOKENS)


class FakeWorker:
    """Plans levels and runs passes as the real worker does, counting every pass it runs by key.
    `budget` packs summaries into merges (group_for_merge: ContextTooSmallError where no two neighbours fit)."""

    def __init__(self, doc: Doc, budget: int):
        self.doc, self.budget = doc, budget
        self.runs: Counter[str] = Counter()
        self.clock = 0.0

    def _spec(self, level: int, index: int, context: int, prompt: tuple[int, ...], final: bool) -> PassSpec:
        return PassSpec(task_id=self.doc.doc_id, doc_id=self.doc.doc_id, key=key_of(prompt), fingerprint=FINGERPRINT,
                        level=level, index=index, context_tokens=context, prompt=prompt,
                        max_new_tokens=NEW_TOKENS, final=final)

    def plan(self, context: int) -> LevelPlan:
        """Level 0: the document cut into ceil(length / context) chunks."""
        n = math.ceil(len(self.doc.tokens) / context)
        specs = tuple(self._spec(0, i, context, chunk_prompt(self.doc, i, context), n == 1) for i in range(n))
        return LevelPlan(specs=specs, groups=(), input_tokens=len(self.doc.tokens))

    def plan_merge(self, texts: list[str], level: int, context: int) -> LevelPlan:
        groups = [(g.start, g.stop) for g in group_for_merge([len(t) for t in texts], self.budget, 1)]
        merged = [texts[start:stop] for start, stop in groups if stop - start > 1]
        specs = tuple(self._spec(level, i, context, merge_prompt(part), len(groups) == 1)
                      for i, part in enumerate(merged))
        return LevelPlan(specs=specs, groups=tuple(groups))

    def plan_for(self, run: DocumentRun) -> LevelPlan:
        return (self.plan(run.context_tokens) if run.level == 0 else
                self.plan_merge(list(run.parts), run.level, run.context_tokens))

    def run(self, spec: PassSpec) -> PassRow:
        assert spec.key == key_of(spec.prompt)
        self.runs[spec.key] += 1
        self.clock += 1.0
        text = text_of(spec.prompt)
        return PassRow(task_id=spec.task_id, doc_id=spec.doc_id, key=spec.key, fingerprint=spec.fingerprint,
                       level=spec.level, index=spec.index, context_tokens=spec.context_tokens,
                       prompt_tokens=len(spec.prompt), tokens=[ord(c) for c in text], text=text,
                       stop_reason="eos", worker="fake:1", finished_at=self.clock, prefill_s=0.001,
                       decode_s=0.002, batch_size=1.0)


def outcome(row: PassRow) -> dict:
    """What the worker reports of a pass it ran, besides the row."""
    return {"worker": row["worker"], "prefill_s": row["prefill_s"], "decode_s": row["decode_s"]}


@dataclass(frozen=True)
class Reference:
    summary: str
    final_key: str
    tree_keys: list[str]  # level by level, every spec's key (as DocumentRun.tree lists them)
    levels: int


def reference(doc: Doc, context: int, budget: int) -> Reference:
    """The document's summary computed straight, with no state machine (a property test rejects a case
    where a level's summaries could not be merged: the real worker fails that document)."""
    n = math.ceil(len(doc.tokens) / context)
    prompts = [chunk_prompt(doc, i, context) for i in range(n)]
    tree, texts, last, levels = [key_of(p) for p in prompts], [text_of(p) for p in prompts], key_of(prompts[0]), 1
    while len(texts) > 1:
        groups = group_for_merge([len(t) for t in texts], budget, 1)
        nxt = []
        for g in groups:
            if len(g) == 1:
                nxt.append(texts[g.start])
            else:
                prompt = merge_prompt(texts[g.start:g.stop])
                tree.append(last := key_of(prompt))
                nxt.append(text_of(prompt))
        texts, levels = nxt, levels + 1
    return Reference(texts[0], last, tree, levels)


def mergeable(doc: Doc, context: int, budget: int) -> Reference:
    try:
        return reference(doc, context, budget)
    except ContextTooSmallError:
        reject()


# -- the driver -------------------------------------------------------------------------------------
class Driver:
    """Drives a DocumentRun as a coordinator would: plans when it is PLANNING, deals its passes and
    completes them. With `rnd` the order is random: passes complete in any order, more are dealt between
    completions, passes of an earlier level or context (`stale`) finish late, and with `lose` a worker is
    presumed lost (`pass_ended`) while its call still finishes later. Without it: one by one, in order."""

    def __init__(self, run: DocumentRun, worker: FakeWorker, rnd: random.Random | None = None, lose: float = 0.0):
        self.run, self.worker, self.rnd, self.lose = run, worker, rnd, lose
        self.inflight: list[PassSpec] = []  # dealt from the current plan, running
        self.stale: list[PassSpec] = []  # still running somewhere, but of an earlier level or context, or ended
        self.done = 0  # passes completed (stale ones included)
        self.extra: Counter[str] = Counter()  # keys that may run once more than once: ended or stale copies
        self.dealt: Counter[str] = Counter()  # passes dealt out, by key
        self.fresh: Counter[str] = Counter()  # passes run as dealt from the current plan, by key
        self.plan = run.plan

    def step(self) -> None:
        run, rnd = self.run, self.rnd
        if self.stale and rnd is not None and rnd.random() < 0.25:
            self.finish_stale()
        elif run.stage is Stage.PLANNING:
            run.planned(self.worker.plan_for(run))
        else:
            assert run.stage in RUNNING
            if not self.inflight or (rnd is not None and rnd.random() < 0.3):
                self.deal()
            assert self.inflight, f"{run.stage} level {run.level}: nothing dealt, nothing in flight"
            spec = self.inflight.pop(rnd.randrange(len(self.inflight)) if rnd is not None else 0)
            assert run.wants(spec) == (spec.key not in run.kept)  # only a late copy of it can have kept it
            if rnd is not None and rnd.random() < self.lose:
                run.pass_ended(spec)  # its worker is presumed lost; its call finishes later, as a stale one
                self.stale.append(spec)
                self.extra[spec.key] += 1
            else:
                row = self.worker.run(spec)
                run.pass_done(row, outcome(row))
                self.fresh[spec.key] += 1
                self.done += 1
        self.settle()

    def deal(self) -> None:
        run = self.run
        dealt = run.next_passes()
        keys = [s.key for s in dealt]
        assert len(set(keys)) == len(keys), "a spec dealt twice at once"
        assert not set(keys) & {s.key for s in self.inflight}, "a spec dealt again while it runs"
        assert run.plan is not None
        plan_keys = {s.key for s in run.plan.specs}
        for spec in dealt:
            assert spec.key in plan_keys and spec.key not in run.kept and run.wants(spec)
            assert (spec.level, spec.context_tokens) == (run.level, run.context_tokens)
        self.inflight.extend(dealt)
        self.dealt.update(keys)

    def finish_stale(self) -> None:
        run, spec = self.run, self.stale.pop(self.rnd.randrange(len(self.stale)) if self.rnd else 0)
        if (run.ended or spec.context_tokens != run.context_tokens or spec.level != run.level
                or spec.key in run.kept):
            assert not run.wants(spec)
        in_plan = run.stage in RUNNING and spec.key in {s.key for s in run.plan.specs}
        before = (run.stage, run.level, run.plan, list(run.parts), len(run.levels), set(run.running))
        summary = run.summary_row["text"] if run.stage is Stage.DONE else None
        row = self.worker.run(spec)
        run.pass_done(row, outcome(row))
        self.done += 1
        assert run.kept[spec.key] is row  # kept, whatever it was of
        if not in_plan:  # not a pass of the current level: it moves nothing
            assert (run.stage, run.level, run.plan, list(run.parts), len(run.levels), set(run.running)) == before
        if summary is not None:
            assert run.stage is Stage.DONE and run.summary_row["text"] == summary

    def settle(self) -> None:
        """A new plan (or none): what was in flight of the old one is kept already (or, after a fall back, stale)."""
        if self.run.plan is not self.plan:
            if self.run.context_tokens == (self.plan.specs[0].context_tokens if self.plan else None):
                assert all(s.key in self.run.kept for s in self.inflight), "a level ended with a pass not kept"
            self.stale.extend(self.inflight)
            self.extra.update(s.key for s in self.inflight)
            self.inflight, self.plan = [], self.run.plan

    def until_end(self, drain: bool = True) -> None:
        for _ in range(10_000):
            if self.run.ended:
                break
            self.step()
        assert self.run.ended, "no end after 10,000 steps"
        while drain and self.stale:
            self.finish_stale()

    def until_done(self, count: int) -> None:
        """Until `count` passes have completed (or the run ended)."""
        while self.done < count and not self.run.ended:
            self.step()


def sequential(doc: Doc, context: int, budget: int) -> tuple[DocumentRun, FakeWorker]:
    run, worker = DocumentRun(_task(doc), context), FakeWorker(doc, budget)
    Driver(run, worker).until_end()
    return run, worker


# -- strategies -------------------------------------------------------------------------------------
docs = st.tuples(st.integers(0, 3), st.integers(1, 48)).flatmap(  # a small alphabet: identical chunks, and
    lambda a: st.lists(st.integers(0, a[0]), min_size=a[1], max_size=a[1])  # chunks shared between contexts
).map(lambda t: Doc("d", tuple(t)))
contexts = st.integers(1, 12)
budgets = st.integers(25, 40)


# -- properties -------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(doc=docs, context=contexts, budget=budgets, rnd=st.randoms(use_true_random=False))
def test_any_order_of_completions_gives_the_sequential_summary_running_each_key_once(doc, context, budget, rnd):
    ref = mergeable(doc, context, budget)
    seq, seq_worker = sequential(doc, context, budget)
    assert seq.stage is Stage.DONE and seq.summary_row["text"] == ref.summary
    assert [r["key"] for r in seq.tree] == ref.tree_keys and seq.summary_row["key"] == ref.final_key
    assert set(seq_worker.runs) == set(ref.tree_keys) and set(seq_worker.runs.values()) == {1}

    run, worker = DocumentRun(_task(doc), context), FakeWorker(doc, budget)
    driver = Driver(run, worker, rnd)
    driver.until_end()
    assert not driver.stale  # no pass outlived its level
    assert run.stage is Stage.DONE and run.summary_row["text"] == ref.summary
    assert run.summary_row["key"] == ref.final_key and len(run.levels) == ref.levels and run.levels[-1].specs[0].final
    assert [r["key"] for r in run.tree] == ref.tree_keys
    assert worker.runs.keys() == set(ref.tree_keys) and set(worker.runs.values()) == {1}  # each key run once
    assert run.ran.keys() == set(ref.tree_keys) and run.running == set() and run.next_passes() == []


@settings(max_examples=100, deadline=None)
@given(doc=docs, context=contexts, budget=budgets, rnd=st.randoms(use_true_random=False), data=st.data())
def test_a_run_made_again_from_the_kept_rows_after_a_kill_ends_alike(doc, context, budget, rnd, data):
    ref = mergeable(doc, context, budget)
    distinct = set(ref.tree_keys)
    kill_after = data.draw(st.integers(0, len(distinct)), label="kill_after")

    old, worker = DocumentRun(_task(doc), context), FakeWorker(doc, budget)
    driver = Driver(old, worker, rnd)
    driver.until_done(kill_after)
    lost = {s.key for s in driver.inflight + driver.stale}  # in flight when it was killed: gone
    kept_before = set(old.kept)
    runs_before = Counter(worker.runs)
    assert kept_before == set(runs_before) and len(kept_before) == min(kill_after, len(distinct))

    again = DocumentRun(_task(doc), context, kept=dict(old.kept))
    worker.runs.clear()
    redriver = Driver(again, worker, rnd)
    redriver.until_end()
    assert again.stage is Stage.DONE and again.summary_row["text"] == ref.summary
    assert [r["key"] for r in again.tree] == ref.tree_keys
    assert not set(worker.runs) & kept_before, "a pass kept before the kill ran again"
    total = runs_before + worker.runs
    assert set(total) == distinct and max(total.values()) == 1
    assert set(worker.runs) == distinct - kept_before == set(again.ran)
    assert (driver.dealt + redriver.dealt).total() == len(distinct) + len(lost)  # only the lost ones twice
    assert not set(redriver.dealt) & kept_before


@settings(max_examples=100, deadline=None)
@given(doc=docs, big=contexts, budget=budgets, rnd=st.randoms(use_true_random=False), data=st.data())
def test_a_fall_back_at_any_point_ends_as_a_clean_run_at_the_shorter_context(doc, big, budget, rnd, data):
    small = data.draw(st.integers(1, max(1, big - 1)), label="small")
    if small == big:
        big += 1
    ref_big, ref_small = mergeable(doc, big, budget), mergeable(doc, small, budget)
    at_boundary = data.draw(st.booleans(), label="at_boundary")

    run, worker = DocumentRun(_task(doc), big), FakeWorker(doc, budget)
    driver = Driver(run, worker, rnd, lose=data.draw(st.sampled_from([0.0, 0.2]), label="lose"))
    if at_boundary:  # the end of a level (before level 0: the start), but the last
        level = data.draw(st.integers(0, ref_big.levels - 1), label="level")
        while not (run.stage is Stage.PLANNING and run.level == level):
            driver.step()
    else:  # anywhere before the end, maybe with the whole level dealt out
        driver.until_done(data.draw(st.integers(0, len(set(ref_big.tree_keys)) - 1), label="completions"))
        if run.stage in RUNNING and data.draw(st.booleans(), label="deal_all"):
            driver.deal()
    assert not run.ended

    run.tries_at_context = 2
    kept_before = set(run.kept)
    stale = driver.inflight + driver.stale  # the old context's passes still running: they finish late
    run.fall_back(small, "note")
    assert run.tries_at_context == 0 and run.fallbacks == ["note"]
    assert (run.stage, run.level, run.plan, run.levels, run.parts, run.running) == (Stage.PLANNING, 0, None, [], [], set())
    assert set(run.kept) == kept_before and run.tree == []
    assert not any(run.wants(s) for s in stale)
    driver.settle()  # what was in flight is stale now
    assert Counter(s.key for s in driver.stale) == Counter(s.key for s in stale) and not driver.inflight
    runs_before = Counter(worker.runs)
    worker.runs.clear()
    driver.fresh.clear()
    driver.dealt.clear()

    driver.until_end()
    assert run.stage is Stage.DONE and run.summary_row["text"] == ref_small.summary
    assert [r["key"] for r in run.tree] == ref_small.tree_keys and len(run.levels) == ref_small.levels
    assert run.fallbacks == ["note"] and run.context_tokens == small
    assert not set(driver.dealt) & kept_before, "a pass kept at the old context was dealt again at the new one"
    assert set(driver.dealt) <= set(ref_small.tree_keys) and set(driver.fresh.values()) <= {1}
    assert set(ref_small.tree_keys) <= set(run.kept) and kept_before <= set(run.kept)
    total = runs_before + worker.runs
    for key, count in total.items():  # each key run once, but for copies that were in flight when dropped
        assert count <= 1 + driver.extra[key], key
    assert set(ref_small.tree_keys) - kept_before <= set(worker.runs)


# -- single steps -----------------------------------------------------------------------------------
def _planned(doc: Doc, context: int, budget: int = 100) -> tuple[DocumentRun, FakeWorker]:
    run, worker = DocumentRun(_task(doc), context), FakeWorker(doc, budget)
    run.planned(worker.plan(context))
    return run, worker


def test_a_one_chunk_document_is_done_after_its_one_pass():
    run, worker = _planned(Doc("one", (1, 2, 3)), 8)
    assert run.stage is Stage.MAPPING and run.plan.specs[0].final
    [spec] = run.next_passes()
    assert run.next_passes() == []
    row = worker.run(spec)
    run.pass_done(row, outcome(row))
    assert run.stage is Stage.DONE and run.ended and run.summary_row is row and run.tree == [row]
    assert run.ran == {row["key"]: outcome(row)}
    read_back = DocumentRun(_task(Doc("one", (1, 2, 3))), 8)
    read_back.planned(worker.plan(8))
    read_back.pass_done(row)  # kept by an earlier batch: done, but not run in this one
    assert read_back.stage is Stage.DONE and read_back.summary_row is row and read_back.ran == {}
    assert run.next_passes() == [] and not run.wants(spec) and run.level == 0


def test_a_pass_ended_without_a_row_is_dealt_again():
    run, worker = _planned(Doc("d", tuple(range(9))), 3)
    dealt = run.next_passes()
    assert len(dealt) == 3 and run.running == {s.key for s in dealt}
    run.pass_ended(dealt[1])
    assert run.next_passes() == [dealt[1]] and run.next_passes() == []
    run.pass_ended(dealt[0])
    run.pass_ended(dealt[2])
    assert run.next_passes() == [dealt[0], dealt[2]]
    for spec in dealt:
        run.pass_done(worker.run(spec))
    assert run.stage is Stage.PLANNING and run.level == 1 and worker.runs.total() == 3


def test_a_spec_is_never_dealt_twice_while_it_runs():
    run, worker = _planned(Doc("d", tuple(range(12))), 3)
    first = run.next_passes()
    assert [s.index for s in first] == [0, 1, 2, 3]
    assert run.next_passes() == []
    run.pass_done(worker.run(first[2]))
    assert run.next_passes() == [] and run.stage is Stage.MAPPING  # one done, three running: none to deal
    assert not run.wants(first[2]) and run.wants(first[0])  # kept: running it again would not help
    assert run.running == {first[0].key, first[1].key, first[3].key}
    for spec in (first[0], first[1], first[3]):
        run.pass_done(worker.run(spec))
    assert run.stage is Stage.PLANNING and set(worker.runs.values()) == {1}


def test_a_plan_arriving_when_none_is_wanted_is_refused():
    doc = Doc("d", tuple(range(8)))
    run, worker = _planned(doc, 4)
    with pytest.raises(ValueError, match="mapping"):
        run.planned(worker.plan(4))
    for spec in run.next_passes():
        run.pass_done(worker.run(spec))
    run.planned(worker.plan_merge(list(run.parts), 1, 4))
    with pytest.raises(ValueError, match="merging"):
        run.planned(worker.plan_merge(list(run.parts), 1, 4))
    for spec in run.next_passes():
        run.pass_done(worker.run(spec))
    assert run.stage is Stage.DONE
    with pytest.raises(ValueError, match="done"):
        run.planned(worker.plan(4))
    failed = DocumentRun(_task(doc), 4)
    failed.fail()
    with pytest.raises(ValueError, match="failed"):
        failed.planned(worker.plan(4))


def test_the_summary_row_is_refused_before_done():
    doc = Doc("d", tuple(range(8)))
    run = DocumentRun(_task(doc), 4)
    with pytest.raises(ValueError, match="planning"):
        _ = run.summary_row
    run, worker = _planned(doc, 4)
    with pytest.raises(ValueError, match="mapping"):
        _ = run.summary_row
    for spec in run.next_passes():
        run.pass_done(worker.run(spec))
    run.planned(worker.plan_merge(list(run.parts), 1, 4))
    with pytest.raises(ValueError, match="merging"):
        _ = run.summary_row
    run.fail()
    with pytest.raises(ValueError, match="failed"):
        _ = run.summary_row


def test_the_tree_lists_the_kept_passes_of_the_levels_at_the_current_context():
    doc = Doc("d", tuple(range(10)))  # at 4: [0:4] [4:8] [8:10]; at 2: five chunks, the last one the same
    run, worker = _planned(doc, 4)
    dealt = run.next_passes()
    rows = [worker.run(s) for s in dealt]
    run.pass_done(rows[1])
    assert run.tree == [rows[1]]
    run.pass_done(rows[0])
    run.pass_done(rows[2])
    assert run.tree == rows and run.stage is Stage.PLANNING
    run.planned(worker.plan_merge(list(run.parts), 1, 4))
    assert run.tree == rows  # the merge is not kept yet
    [merge] = run.next_passes()
    merged = worker.run(merge)
    run.pass_done(merged)
    assert run.tree == [*rows, merged] and run.summary_row is merged

    run.fall_back(2, "shorter")
    assert run.tree == [] and len(run.kept) == 4
    run.planned(worker.plan(2))
    assert run.tree == [rows[2]]  # the one chunk cut alike at both contexts counts at once
    assert rows[2]["key"] not in {s.key for s in run.next_passes()}
    assert run.tree == [rows[2]]


def test_a_failed_run_ends_and_deals_nothing():
    run, worker = _planned(Doc("d", tuple(range(9))), 3)
    dealt = run.next_passes()
    run.pass_ended(dealt[0])
    run.fail()
    assert run.ended and run.stage is Stage.FAILED
    assert run.next_passes() == [] and not any(run.wants(s) for s in dealt)
    row = worker.run(dealt[1])
    run.pass_done(row)  # a late pass is still kept, and moves nothing
    assert run.kept[row["key"]] is row and run.stage is Stage.FAILED and run.next_passes() == []


def test_two_identical_chunks_are_dealt_once_and_both_count():
    run, worker = _planned(Doc("d", (5, 6, 5, 6)), 2)
    assert len(run.plan.specs) == 2 and run.plan.specs[0].key == run.plan.specs[1].key
    [spec] = run.next_passes()
    assert run.next_passes() == []
    row = worker.run(spec)
    run.pass_done(row)
    assert run.stage is Stage.PLANNING and run.level == 1 and run.parts == [row["text"], row["text"]]
    assert run.tree == [row, row]
    run.planned(worker.plan_merge(list(run.parts), 1, 2))
    [merge] = run.next_passes()
    run.pass_done(worker.run(merge))
    assert run.stage is Stage.DONE and run.summary_row["text"] == reference(Doc("d", (5, 6, 5, 6)), 2, 100).summary
    assert worker.runs.total() == 2


def test_a_late_pass_of_a_context_given_up_is_kept_but_moves_nothing():
    doc = Doc("d", tuple(range(12)))
    run, worker = _planned(doc, 6)
    old = run.next_passes()
    run.fall_back(4, "shorter")
    run.planned(worker.plan(4))
    new = run.next_passes()
    assert not any(run.wants(s) for s in old) and all(run.wants(s) for s in new)
    late = worker.run(old[0])
    run.pass_done(late)
    assert run.kept[late["key"]] is late and run.stage is Stage.MAPPING and run.tree == []
    assert run.running == {s.key for s in new} and run.next_passes() == []
    for spec in new:
        run.pass_done(worker.run(spec))
    assert run.stage is Stage.PLANNING and run.level == 1 and late not in run.tree


def test_one_worker_loss_that_ends_several_of_its_calls_is_one_failed_attempt() -> None:
    run = DocumentRun(_task(Doc("d", (1, 2, 3))), 8)
    run.begin()
    assert run.first_loss(("worker slot 0", 0)) and not run.first_loss(("worker slot 0", 0))  # two calls, one loss
    run.call_failed(own=True)
    run.begin()  # the call handed back begins again: attempt 2
    assert (run.attempt, run.tries_at_context) == (2, 1)
    assert run.first_loss(("worker slot 0", 1)) and run.first_loss(None)  # the restarted one lost too: new
    run.call_failed(own=False)  # shared with batch-mates: not held against it
    run.begin()
    assert (run.attempt, run.tries_at_context) == (3, 1)
