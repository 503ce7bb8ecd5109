"""The Parquet checkpoint log: atomic parts, corrupt-part tolerance, exactly-once results, compaction."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.schema import EVENT_SCHEMA, RESULT_SCHEMA, empty_row
from storage.checkpoint import EVENTS_DIR, RESULTS_DIR, CheckpointLog, CheckpointRowError, compact, load_state
from storage.passes import read_passes, tasks_with_passes
from storage.parts import TEMP_PREFIX, list_parts, list_temp_files, merge_parts, read_parts, write_part
from tests.helpers.child_process import Child
from tests.helpers.results import kept_pass
from tests.helpers.system import fill_disk, mounted_tmpfs


def result(doc_id: str, status: str = "done", **fields) -> dict:
    return {**empty_row(RESULT_SCHEMA), "doc_id": doc_id, "task_id": f"t-{doc_id}", "status": status,
            "fallbacks": [], **fields}


def event(task_id: str, state: str, attempt: int = 1) -> dict:
    return {**empty_row(EVENT_SCHEMA), "task_id": task_id, "attempt": attempt, "state": state, "ts": time.time()}


def results_table(*rows: dict) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=RESULT_SCHEMA)


def summaries_by_doc(state) -> dict[str, tuple[str, str | None, str | None]]:
    return {row["doc_id"]: (row["status"], row["summary"], row["error"]) for row in state.results.to_pylist()}


# --- atomic parts -------------------------------------------------------------------------------


def test_parts_read_back_in_write_order(tmp_path: Path) -> None:
    for i in range(5):
        write_part(tmp_path, results_table(result(f"d{i}a"), result(f"d{i}b")))
    table, corrupt = read_parts(tmp_path, RESULT_SCHEMA)
    assert corrupt == []
    assert table.column("doc_id").to_pylist() == [f"d{i}{s}" for i in range(5) for s in "ab"]
    names = [path.name for path in list_parts(tmp_path)]
    assert len(set(names)) == 5


def test_sigkill_mid_write_leaves_no_visible_part(tmp_path: Path) -> None:
    """A writer killed while writing a large part leaves only its temporary file, which readers ignore."""
    child = Child(
        """
        import sys
        from pathlib import Path
        import numpy as np
        import pyarrow as pa
        from storage.parts import write_part

        def table(n):
            blob = pa.FixedSizeBinaryArray.from_buffers(pa.binary(64), n, [None, pa.py_buffer(np.random.bytes(64 * n))])
            return pa.table({"x": pa.array(np.arange(n)), "blob": blob})

        write_part(Path(sys.argv[1]), table(3))
        big = table(1_000_000)  # 64 MB of incompressible bytes: a write takes a while
        print("writing", flush=True)
        while True:
            write_part(Path(sys.argv[1]), big)
        """,
        str(tmp_path),
    )
    try:
        assert child.read_line() == "writing"
        deadline = time.monotonic() + 30
        while not list_temp_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.02)
    finally:
        child.kill()
    assert list_temp_files(tmp_path), "the child was not killed in the middle of a write"
    table, corrupt = read_parts(tmp_path, pa.schema([("x", pa.int64()), ("blob", pa.binary(64))]))
    assert corrupt == []
    assert table.num_rows % 1_000_000 == 3  # the small part and whole big parts only
    assert table.column("x").to_pylist()[:3] == [0, 1, 2]


def test_corrupt_parts_of_each_kind_are_skipped_and_reported(tmp_path: Path) -> None:
    good = write_part(tmp_path, results_table(result("a"), result("b")))
    torn_source = write_part(tmp_path, results_table(*(result(f"x{i}", summary="s" * 200) for i in range(50))))
    torn_bytes = torn_source.read_bytes()
    torn_source.delete()
    (tmp_path / "part-00000000000000000001-torn.parquet").write_bytes(torn_bytes[: len(torn_bytes) // 2])
    (tmp_path / "part-00000000000000000002-empty.parquet").write_bytes(b"")
    (tmp_path / "part-00000000000000000003-garbage.parquet").write_bytes(b"not parquet at all\n" * 100)
    pq.write_table(pa.table({"doc_id": ["z"]}), tmp_path / "part-00000000000000000004-missing.parquet")
    wrong_type = results_table(result("w")).set_column(
        RESULT_SCHEMA.get_field_index("attempts"), "attempts", pa.array(["one"])
    )
    pq.write_table(wrong_type, tmp_path / "part-00000000000000000005-wrongtype.parquet")
    (tmp_path / f"{TEMP_PREFIX}part-00000000000000000006-x.parquet").write_bytes(b"half a write")

    table, corrupt = read_parts(tmp_path, RESULT_SCHEMA)

    assert table.column("doc_id").to_pylist() == ["a", "b"]
    reasons = {c.path.name.split("-")[-1]: c.reason for c in corrupt}
    assert set(reasons) == {"torn.parquet", "empty.parquet", "garbage.parquet", "missing.parquet",
                            "wrongtype.parquet"}
    assert "unreadable Parquet" in reasons["torn.parquet"]
    assert "empty file" in reasons["empty.parquet"]
    assert "unreadable Parquet" in reasons["garbage.parquet"]
    assert "missing column(s) task_id" in reasons["missing.parquet"]
    assert "column attempts is string, expected int32" in reasons["wrongtype.parquet"]
    assert good.exists()


def test_load_state_reports_corrupt_parts_and_keeps_going(tmp_path: Path) -> None:
    write_part(tmp_path / RESULTS_DIR, results_table(result("a")))
    (tmp_path / RESULTS_DIR / "part-00000000000000000001-bad.parquet").write_bytes(b"\0" * 10)
    (tmp_path / EVENTS_DIR).mkdir()
    (tmp_path / EVENTS_DIR / "part-00000000000000000001-bad.parquet").write_bytes(b"")
    state = load_state(tmp_path)
    assert state.done_task_ids == {"t-a"}
    assert sorted(c.path.parent.name for c in state.corrupt) == [EVENTS_DIR, RESULTS_DIR]


# --- exactly-once results -----------------------------------------------------------------------


def test_dedup_keeps_first_done_else_latest_row(tmp_path: Path) -> None:
    log = CheckpointLog(tmp_path, flush_every=2)
    log.add_result(result("a", "failed", error="boom 1"))
    log.add_result(result("b", "failed", error="first failure"))
    log.add_result(result("a", "done", summary="first summary"))
    log.add_result(result("c", "rejected", error="empty text"))
    log.add_result(result("a", "done", summary="second summary"))
    log.add_result(result("b", "failed", error="latest failure"))
    log.add_result(result("d", "done", summary="d summary"))
    log.add_result(result("d", "failed", error="rerun after done"))
    log.close()

    state = load_state(tmp_path)

    assert summaries_by_doc(state) == {
        "a": ("done", "first summary", None),
        "b": ("failed", None, "latest failure"),
        "c": ("rejected", None, "empty text"),
        "d": ("done", "d summary", None),
    }
    assert state.done_task_ids == {"t-a", "t-d"}
    assert state.failed_task_ids == {"t-b"}
    assert state.rejected_task_ids == {"t-c"}
    assert state.duplicate_results == 4
    assert state.results.column("doc_id").to_pylist() == ["a", "c", "b", "d"]  # winning rows in write order


outcomes = st.lists(st.tuples(st.sampled_from("abcde"), st.sampled_from(["done", "failed", "rejected"])),
                    max_size=30)


@settings(max_examples=40, deadline=None)
@given(rows=outcomes, part_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_dedup_matches_reference_for_any_history(rows: list[tuple[str, str]], part_sizes: list[int]) -> None:
    """However rows are split into parts, each document ends with exactly one row: its first done, else its latest."""
    expected: dict[str, int] = {}
    for i, (doc, status) in enumerate(rows):
        if expected.get(doc) is None or rows[expected[doc]][1] != "done":
            expected[doc] = i
    with tempfile.TemporaryDirectory() as job:
        start, sizes = 0, iter(part_sizes * 30)
        while start < len(rows):
            size = next(sizes)
            batch = [result(doc, status, summary=str(start + k)) for k, (doc, status) in
                     enumerate(rows[start:start + size])]
            write_part(Path(job) / RESULTS_DIR, results_table(*batch))
            start += size
        state = load_state(Path(job))
    assert {doc: int(summary) for doc, (_, summary, _) in summaries_by_doc(state).items()} == expected
    assert state.done_task_ids == {f"t-{doc}" for doc, i in expected.items() if rows[i][1] == "done"}


# --- the log's batching ---------------------------------------------------------------------------


def test_a_result_and_passes_are_on_disk_when_the_call_returns_and_events_wait_for_them(tmp_path: Path) -> None:
    """What the log is told is kept is published before the call returns (job.log and the progress bar
    announce it only after); events wait for the next write, `flush_every` events or close."""
    log = CheckpointLog(tmp_path, flush_every=4, flush_interval_s=3600)
    log.add_event(event("t1", "running"))
    assert load_state(tmp_path).events.num_rows == 0
    log.add_result(result("d1"))
    state = load_state(tmp_path)
    assert state.done_task_ids == {"t-d1"} and state.events.num_rows == 1  # the event rode along
    log.add_passes([kept_pass("t-d2", "k1")])
    assert [row["key"] for row in read_passes(tmp_path, "t-d2")] == ["k1"]
    for i in range(3):
        log.add_event(event(f"t{i + 2}", "running"))
    assert load_state(tmp_path).events.num_rows == 1
    log.add_event(event("t5", "running"))  # the fourth buffered event
    assert load_state(tmp_path).events.num_rows == 5
    log.add_event(event("t6", "running"))
    log.close()
    assert load_state(tmp_path).events.num_rows == 6
    with pytest.raises(RuntimeError, match="closed"):
        log.add_result(result("d3"))


def test_log_flushes_events_after_the_interval_without_more_rows(tmp_path: Path) -> None:
    with CheckpointLog(tmp_path, flush_every=1000, flush_interval_s=0.2) as log:
        log.add_event(event("t1", "running"))
        assert load_state(tmp_path).events.num_rows == 0
        deadline = time.monotonic() + 10
        while not load_state(tmp_path).events.num_rows and time.monotonic() < deadline:
            time.sleep(0.05)
        assert load_state(tmp_path).events.num_rows == 1


def test_callers_that_finish_together_share_one_write(tmp_path: Path) -> None:
    """A group commit: while one caller's write is under way, the results of others queue and go out
    together in the next write, each caller returning once its own row is on disk."""
    writing, release = threading.Event(), threading.Event()

    def fence() -> None:  # called before every part is published: holds the first write
        if not writing.is_set():
            writing.set()
            assert release.wait(30)

    log = CheckpointLog(tmp_path, flush_every=1000, flush_interval_s=3600, fence=fence)
    first = threading.Thread(target=log.add_result, args=(result("d0"),))
    first.start()
    assert writing.wait(30)  # the moment: d0's write holds the writer's turn
    others = [threading.Thread(target=log.add_result, args=(result(f"d{i}"),)) for i in range(1, 9)]
    others.append(threading.Thread(target=log.add_passes, args=([kept_pass("t-d1", "k1")],)))
    for thread in others:
        thread.start()
    deadline = time.monotonic() + 30
    while log._pending() < 9:  # all eight and d1's pass queued behind the write under way
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.set()
    for thread in [first, *others]:
        thread.join(30)
    assert len(list_parts(tmp_path / RESULTS_DIR)) == 2  # d0's part, then one part for the other eight
    assert len(load_state(tmp_path).done_task_ids) == 9
    assert tasks_with_passes(tmp_path) == []  # d1's pass went out with its result: not needed any more
    log.close()


def test_log_is_safe_across_threads(tmp_path: Path) -> None:
    import threading

    with CheckpointLog(tmp_path, flush_every=7, merge_every=3) as log:
        def report(worker: int) -> None:
            for i in range(200):
                log.add_event(event(f"w{worker}-{i}", "running"))
                log.add_result(result(f"w{worker}-{i}"))

        threads = [threading.Thread(target=report, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    state = load_state(tmp_path)
    assert len(state.done_task_ids) == 800 and state.duplicate_results == 0 and state.events.num_rows == 800
    for w in range(4):  # each worker's rows keep their order
        mine = [d for d in state.results.column("doc_id").to_pylist() if d.startswith(f"w{w}-")]
        assert mine == [f"w{w}-{i}" for i in range(200)]


def test_log_merges_its_parts_while_running(tmp_path: Path) -> None:
    with CheckpointLog(tmp_path, flush_every=1, merge_every=4) as log:
        for i in range(50):
            log.add_result(result(f"d{i}"))
            assert len(list_parts(tmp_path / RESULTS_DIR)) <= 4 + i // 4
    assert len(list_parts(tmp_path / RESULTS_DIR)) <= 50 // 4 + 4
    assert load_state(tmp_path).results.column("doc_id").to_pylist() == [f"d{i}" for i in range(50)]


def test_reading_while_a_live_writer_merges_gives_consistent_views(tmp_path: Path) -> None:
    """`kvbatch status` during a run: parts merged away mid-read are neither lost, doubled nor 'corrupt'."""
    writer = Child(
        """
        import sys
        from jobs.schema import RESULT_SCHEMA, empty_row
        from storage.checkpoint import CheckpointLog
        with CheckpointLog(sys.argv[1], flush_every=1, merge_every=3) as log:
            for i in range(600):
                log.add_result({**empty_row(RESULT_SCHEMA), "doc_id": f"d{i}", "task_id": f"t{i}", "status": "done"})
                if i == 10:
                    print("writing", flush=True)
        """,
        str(tmp_path),
    )
    assert writer.read_line() == "writing"
    seen = []
    while writer.process.poll() is None:
        state = load_state(tmp_path)
        assert state.corrupt == [] and state.duplicate_results == 0
        seen.append(len(state.done_task_ids))
    writer.finish()
    assert len(seen) > 3 and seen == sorted(seen)
    assert len(load_state(tmp_path).done_task_ids) == 600


def test_rows_that_do_not_fit_are_named_and_the_rest_is_written(tmp_path: Path) -> None:
    log = CheckpointLog(tmp_path, flush_every=100)
    with pytest.raises(CheckpointRowError, match=r"doc_id 'd1'.*unknown results column\(s\) \['sumary'\]"):
        log.add_result({**result("d1"), "sumary": "typo"})
    log.add_result(result("ok"))
    with pytest.raises(CheckpointRowError, match="1 results row.*doc_id 'bad'"):
        log.add_result(result("bad", attempts="three"))
    log.close()
    assert load_state(tmp_path).done_task_ids == {"t-ok"}


# --- compaction -------------------------------------------------------------------------------


def write_job(job: Path, n_tasks: int, per_part: int = 3) -> None:
    """A job folder of many small parts: `per_part` tasks' rows in each, as a log writes them when that
    many tasks end together."""
    with CheckpointLog(job, flush_every=2 * per_part, merge_every=10_000) as log:
        for start in range(0, n_tasks, per_part):
            batch = range(start, min(start + per_part, n_tasks))
            for i in batch:
                log.add_event(event(f"t{i}", "running"))
            write_part(job / RESULTS_DIR, results_table(*(
                result(f"d{i % (n_tasks - 3)}", "done" if i % 5 else "failed", summary=f"s{i}") for i in batch)))
            for i in batch:
                log.add_event(event(f"t{i}", "done"))


def assert_same_state(job: Path, before) -> None:
    after = load_state(job)
    assert after.corrupt == []
    assert after.results.equals(before.results)
    assert after.events.equals(before.events)


def test_compact_keeps_every_row_in_one_part_per_directory(tmp_path: Path) -> None:
    write_job(tmp_path, 60)
    (tmp_path / RESULTS_DIR / f"{TEMP_PREFIX}part-left-by-a-crash.parquet").write_bytes(b"partial")
    before = load_state(tmp_path)
    raw_before, _ = read_parts(tmp_path / RESULTS_DIR, RESULT_SCHEMA)
    assert len(list_parts(tmp_path / RESULTS_DIR)) > 10

    compact(tmp_path)

    assert len(list_parts(tmp_path / RESULTS_DIR)) == 1 and len(list_parts(tmp_path / EVENTS_DIR)) == 1
    assert list_temp_files(tmp_path / RESULTS_DIR) == []
    assert read_parts(tmp_path / RESULTS_DIR, RESULT_SCHEMA)[0].equals(raw_before)  # duplicates kept too
    assert_same_state(tmp_path, before)
    compact(tmp_path)  # nothing left to do
    assert_same_state(tmp_path, before)


def test_crash_between_publish_and_removal_leaves_no_duplicates(tmp_path: Path) -> None:
    """The exact state a crash leaves after the merged part is published and before its inputs go."""
    write_job(tmp_path, 40)
    before = load_state(tmp_path)
    saved = tmp_path.parent / "saved-events"
    shutil.copytree(tmp_path / EVENTS_DIR, saved)
    merge_parts(tmp_path / EVENTS_DIR, EVENT_SCHEMA)
    for part in saved.iterdir():
        shutil.copy2(part, tmp_path / EVENTS_DIR / part.name)
    assert len(list_parts(tmp_path / EVENTS_DIR)) > 2

    assert_same_state(tmp_path, before)  # inputs are superseded, not counted twice
    compact(tmp_path)
    assert len(list_parts(tmp_path / EVENTS_DIR)) == 1
    assert_same_state(tmp_path, before)


def kill_compaction_when(job: Path, moment) -> None:
    """Run compact() in a child and SIGKILL it as soon as `moment(job)` is true."""
    child = Child(
        """
        import sys
        from storage.checkpoint import compact
        print("start", flush=True)
        compact(sys.argv[1])
        """,
        str(job),
    )
    try:
        assert child.read_line() == "start"
        deadline = time.monotonic() + 60
        while not moment(job) and child.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert moment(job), "compaction finished before the moment to kill it came"
    finally:
        child.kill()


def test_compaction_killed_at_each_step_loses_nothing(tmp_path: Path) -> None:
    write_job(tmp_path, 2400, per_part=9)
    before = load_state(tmp_path)
    originals = {d: set(list_parts(tmp_path / d)) for d in (RESULTS_DIR, EVENTS_DIR)}

    def writing(directory: str):
        return lambda job: bool(list_temp_files(job / directory))

    def published(directory: str):
        return lambda job: bool(set(list_parts(job / directory)) - originals[directory])

    for moment in (writing(RESULTS_DIR), published(RESULTS_DIR), writing(EVENTS_DIR), published(EVENTS_DIR)):
        kill_compaction_when(tmp_path, moment)
        assert_same_state(tmp_path, before)
    assert len(list_parts(tmp_path / EVENTS_DIR)) > 1, "the last kill came after the inputs were removed"

    compact(tmp_path)
    assert len(list_parts(tmp_path / RESULTS_DIR)) == 1 and len(list_parts(tmp_path / EVENTS_DIR)) == 1
    assert_same_state(tmp_path, before)


def test_a_part_written_before_a_column_was_added_reads_with_nulls(tmp_path: Path) -> None:
    """Job folders outlive versions: a results part without later columns still counts as done."""
    old_columns = [name for name in RESULT_SCHEMA.names if name not in ("queue_wait_s", "prefill_s", "decode_s")]
    older = pa.Table.from_pylist([result("a")], schema=RESULT_SCHEMA).select(old_columns)
    (tmp_path / "results").mkdir()
    pq.write_table(older, tmp_path / "results" / "part-00000000000000000001-old.parquet")
    state = load_state(tmp_path)
    assert state.corrupt == [] and state.done_task_ids == {"t-a"}
    assert state.results.column("prefill_s").to_pylist() == [None]


def test_a_full_disk_in_the_interval_flush_goes_to_the_next_caller_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The interval flusher printed "periodic checkpoint flush ... failed" with an OSError traceback on the
    console before submit's exit-6 line: the error is the next caller's to report (submit: exit 6), not its."""
    import errno

    with mounted_tmpfs(tmp_path / "small", "size=1m") as disk:
        log = CheckpointLog(disk, flush_every=1000, flush_interval_s=0.1)
        (disk / RESULTS_DIR).mkdir(exist_ok=True)
        fill_disk(disk)
        log.add_event(event("t-d1", "running"))
        deadline = time.monotonic() + 30
        while log._background_error is None:  # the moment: the interval flush has failed
            assert time.monotonic() < deadline, "the interval flush never ran"
            time.sleep(0.01)
        with pytest.raises(OSError) as raised:
            log.add_event(event("t-d1", "retrying"))
        assert raised.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as raised:  # a result is written at once: its caller hears of the full disk
            log.add_result(result("d1"))
        assert raised.value.errno == errno.ENOSPC
        (disk / "filler").unlink()
        log.close()  # once there is space again, nothing buffered was lost
        state = load_state(disk)
        assert state.done_task_ids == {"t-d1"} and state.events.num_rows == 2
    loud = [r for r in caplog.records if r.name == "storage.checkpoint" and r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
