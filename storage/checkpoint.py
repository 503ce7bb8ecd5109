"""The job's checkpoint log: task events, results and finished passes as append-only Parquet parts.

`add_result`/`add_passes` return once their rows are on disk (one fsynced group commit for the callers
finishing together), so whatever is announced after them survives a `kill -9`; task events are buffered
(docs/cluster.md, "Crashes, retries and fallbacks"). Results go before the events and passes of the same
write, and every `merge_every` parts are merged into one, so a resume reads few files.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.passes import PassRow
from jobs.schema import EVENT_SCHEMA, RESULT_SCHEMA, TaskState
from storage.location import Fence, Location, Where, no_fence
from storage.parts import CorruptPart, list_temp_files, merge_parts, read_parts, replace_parts, write_part
from storage.passes import write_passes

logger = logging.getLogger(__name__)

EVENTS_DIR = "events"
RESULTS_DIR = "results"
DEFAULT_MERGE_EVERY = 64


class CheckpointRowError(ValueError):
    """A row that does not fit its schema; the message names the task and the offending value."""


def _row_label(row: dict[str, Any]) -> str:
    return ", ".join(f"{key} {row[key]!r}" for key in ("doc_id", "task_id") if row.get(key) is not None) or "row"


class _Stream:
    """One directory of parts (events or results) and the rows not yet published to it."""

    def __init__(self, directory: Location, schema: pa.Schema, fence: Fence) -> None:
        self.directory = directory
        self.fence = fence
        self.schema = schema
        self.columns = frozenset(schema.names)
        self.pending: list[dict[str, Any]] = []
        self.unmerged: list[tuple[Location, pa.Table]] = []  # parts this log wrote, kept to merge without rereading

    def check_keys(self, row: dict[str, Any]) -> None:
        if unknown := row.keys() - self.columns:
            raise CheckpointRowError(
                f"{_row_label(row)}: unknown {self.directory.name} column(s) {sorted(unknown)}; "
                f"allowed: {', '.join(self.schema.names)}"
            )

    def _convert(self, rows: list[dict[str, Any]]) -> tuple[pa.Table, list[str]]:
        """Arrow table of `rows`, leaving out (and describing) rows that do not fit."""
        try:
            return pa.Table.from_pylist(rows, schema=self.schema), []
        except (pa.ArrowException, TypeError, ValueError):
            good, rejected = [], []
            for row in rows:
                try:
                    pa.Table.from_pylist([row], schema=self.schema)
                    good.append(row)
                except (pa.ArrowException, TypeError, ValueError) as exc:
                    rejected.append(f"{_row_label(row)}: {exc}")
            return pa.Table.from_pylist(good, schema=self.schema), rejected

    def publish(self, rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """Write `rows` as one part: the task ids written, and a description of each row left out."""
        table, rejected = self._convert(rows)
        if table.num_rows:
            self.unmerged.append((write_part(self.directory, table, fence=self.fence), table))
        return table.column("task_id").to_pylist(), rejected

    def merge_if_due(self, merge_every: int) -> None:
        if len(self.unmerged) >= merge_every:
            merged = pa.concat_tables([table for _, table in self.unmerged])
            replace_parts(self.directory, merged, [path for path, _ in self.unmerged], self.fence)
            self.unmerged = []


class CheckpointLog:
    """Thread-safe writer of a job's events/, results/ and passes/ (see the module): the job folder's only writer."""

    def __init__(
        self,
        job_dir: Where,
        flush_every: int = 32,
        flush_interval_s: float = 5.0,
        merge_every: int = DEFAULT_MERGE_EVERY,
        fence: Fence = no_fence,
        after_results: Callable[[list[str]], None] | None = None,
    ) -> None:
        """`fence` is called before every publish (the job lock's check); `after_results` with the task
        ids of every part of results once it is published (what may go now that they are recorded)."""
        if flush_every < 1 or flush_interval_s <= 0 or merge_every < 2:
            raise ValueError(
                f"checkpoint settings must be flush_every >= 1, flush_interval_s > 0, merge_every >= 2; "
                f"got {flush_every}, {flush_interval_s}, {merge_every}"
            )
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.merge_every = merge_every
        job_dir = Location.of(job_dir)
        self._job_dir = job_dir
        self._fence = fence
        self._after_results = after_results
        self._results = _Stream(job_dir / RESULTS_DIR, RESULT_SCHEMA, fence)
        self._events = _Stream(job_dir / EVENTS_DIR, EVENT_SCHEMA, fence)
        self._passes: dict[str, list[PassRow]] = {}  # task id -> its finished passes not yet published
        self._lock = threading.Condition()  # the queues and counters below
        self._turn = threading.Lock()  # the writer's turn: one write at a time, taken before `_lock`
        self._added = 0  # rows ever added
        self._published = 0  # rows added before the last write that succeeded
        self._oldest_pending: float | None = None
        self._closed = False
        self._background_error: Exception | None = None
        self._timer = threading.Thread(target=self._flush_when_interval_passes, name="checkpoint-flush", daemon=True)
        self._timer.start()

    def add_event(self, row: dict[str, Any]) -> None:
        """A task's way to its end: buffered (see the module)."""
        self._add(self._events, row, kept=False)

    def add_result(self, row: dict[str, Any]) -> None:
        """A document's end: on disk when this returns."""
        self._add(self._results, row, kept=True)

    def add_passes(self, rows: list[PassRow]) -> None:
        """Finished passes of documents still running: on disk when this returns."""
        with self._lock:
            for row in rows:
                self._passes.setdefault(row["task_id"], []).append(row)
            ticket = self._queued(len(rows))
        self._commit(ticket)

    def _add(self, stream: _Stream, row: dict[str, Any], kept: bool) -> None:
        stream.check_keys(row)
        with self._lock:
            stream.pending.append(dict(row))
            ticket = self._queued(1)
            due = kept or self._pending() >= self.flush_every
        if due:
            self._commit(ticket)
        else:
            self._raise_background_error()

    def _queued(self, rows: int) -> int:
        """Count `rows` just queued (holding `_lock`); their ticket: the rows added up to them."""
        if self._closed:
            raise RuntimeError(f"checkpoint log of {self._job_dir} is closed")
        self._added += rows
        if self._oldest_pending is None:
            self._oldest_pending = time.monotonic()
            self._lock.notify()
        return self._added

    def _pending(self) -> int:
        return len(self._results.pending) + len(self._events.pending) + sum(map(len, self._passes.values()))

    def _commit(self, ticket: int | None = None) -> None:
        """Publish the rows added up to `ticket` (None: all) unless another caller's write took them meanwhile."""
        with self._turn:
            if ticket is None or self._published < ticket:
                self._write()
        self._raise_background_error()

    def _write(self) -> None:
        """One turn of the writer (holding `_turn`): every queued row, results first. What is not published
        when it fails goes back to the queue; `upto`, the rows added before it, tells callers theirs went out."""
        with self._lock:
            results, passes, events, upto = self._results.pending, self._passes, self._events.pending, self._added
            self._results.pending, self._passes, self._events.pending = [], {}, []
            self._oldest_pending = None
        rejected: dict[str, list[str]] = {}
        try:
            published, rejected[RESULTS_DIR] = self._results.publish(results)  # the done record: first
            results = []
            if published:
                with self._lock:
                    for task_id in published:  # their passes are not needed any more
                        passes.pop(task_id, None)
                        self._passes.pop(task_id, None)
                if self._after_results is not None:
                    self._after_results(published)
            while passes:
                task_id, rows = next(iter(passes.items()))
                write_passes(self._job_dir, task_id, rows, self._fence)
                del passes[task_id]
            rejected[EVENTS_DIR] = self._events.publish(events)[1]
            events = []
            for stream in (self._results, self._events):
                stream.merge_if_due(self.merge_every)
        finally:
            with self._lock:
                if results or passes or events:  # back in front of what came meanwhile
                    self._results.pending[:0] = results
                    for task_id, rows in passes.items():
                        self._passes[task_id] = rows + self._passes.get(task_id, [])
                    self._events.pending[:0] = events
                    self._oldest_pending = time.monotonic()  # the interval flusher tries again after a while
                else:
                    self._published = upto
        if any(rejected.values()):
            raise CheckpointRowError("; ".join(
                f"{len(rows)} {name} row(s) do not fit the schema and were not written: " + "; ".join(rows)
                for name, rows in rejected.items() if rows
            ))

    def _raise_background_error(self) -> None:
        """Hand an error of the interval flusher to the next caller, who can act on it."""
        with self._lock:
            error, self._background_error = self._background_error, None
        if error is not None:
            raise error

    def _flush_when_interval_passes(self) -> None:
        while self._interval_passed():
            try:
                with self._turn:
                    self._write()
            except Exception as exc:  # unpublished rows stay buffered for the next flush
                # the next caller raises it and says what to do (a full disk: exit 6): no traceback here
                logger.debug("periodic checkpoint flush of %s failed", self._results.directory.parent,
                             exc_info=True)
                with self._lock:
                    self._background_error = exc

    def _interval_passed(self) -> bool:
        """Wait until the oldest buffered row is `flush_interval_s` old (True) or the log closes (False)."""
        with self._lock:
            while not self._closed:
                if self._oldest_pending is None:
                    self._lock.wait()
                    continue
                remaining = self._oldest_pending + self.flush_interval_s - time.monotonic()
                if remaining <= 0:
                    return True
                self._lock.wait(remaining)
            return False

    def close(self) -> None:
        """Publish what is buffered and stop the interval flusher; later adds raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify()
        self._timer.join()
        self._commit()

    def __enter__(self) -> CheckpointLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class JobState:
    """What the checkpoint log says about a job, one result per task (one manifest row)."""

    results: pa.Table
    events: pa.Table
    done_task_ids: frozenset[str]
    failed_task_ids: frozenset[str]
    rejected_task_ids: frozenset[str]
    corrupt: list[CorruptPart] = field(default_factory=list)
    duplicate_results: int = 0  # result rows dropped because their task already had a winning row


def _winning_result_rows(results: pa.Table) -> np.ndarray:
    """Row indices (in write order) of each task's winning result: its first done row (a later one
is a task that finished twice, e.g. after a timeout), else its latest row (a rerun's failure wins)."""
    n = results.num_rows
    index = np.arange(n, dtype=np.int64)
    is_done = pc.equal(results["status"], TaskState.DONE.value).fill_null(False).to_numpy(zero_copy_only=False)
    rank = np.where(is_done, index, 2 * n - index)  # done rows first by age, then others newest first
    best = (
        pa.table({"task_id": results["task_id"], "rank": rank})
        .group_by("task_id", use_threads=False)
        .aggregate([("rank", "min")])["rank_min"]
        .to_numpy()
    )
    return np.sort(np.where(best < n, best, 2 * n - best))


def _task_ids_with_status(results: pa.Table, status: TaskState) -> frozenset[str]:
    mask = pc.equal(results["status"], status.value).fill_null(False)
    return frozenset(results["task_id"].filter(mask).to_pylist())


def load_state(job_dir: Where) -> JobState:
    """Read the whole log: deduplicated results, all events, and any part that had to be skipped."""
    job_dir = Location.of(job_dir)
    raw_results, corrupt_results = read_parts(job_dir / RESULTS_DIR, RESULT_SCHEMA)
    events, corrupt_events = read_parts(job_dir / EVENTS_DIR, EVENT_SCHEMA)
    results = raw_results.take(_winning_result_rows(raw_results)) if raw_results.num_rows else raw_results
    for part in corrupt_results + corrupt_events:
        logger.warning("skipped corrupt checkpoint part %s", part)
    return JobState(
        results=results,
        events=events,
        done_task_ids=_task_ids_with_status(results, TaskState.DONE),
        failed_task_ids=_task_ids_with_status(results, TaskState.FAILED),
        rejected_task_ids=_task_ids_with_status(results, TaskState.REJECTED),
        corrupt=corrupt_results + corrupt_events,
        duplicate_results=raw_results.num_rows - results.num_rows,
    )


def compact(job_dir: Where, fence: Fence = no_fence) -> None:
    """Merge each of events/ and results/ into one part, keeping every row (load_state deduplicates),
and remove the temporary files of crashed writers: call with the job lock held and the log closed."""
    job_dir = Location.of(job_dir)
    for directory, schema in ((job_dir / RESULTS_DIR, RESULT_SCHEMA), (job_dir / EVENTS_DIR, EVENT_SCHEMA)):
        merge_parts(directory, schema, fence)
        fence()
        for leftover in list_temp_files(directory):
            leftover.delete()
