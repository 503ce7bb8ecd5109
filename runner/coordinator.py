"""The coordinator: runs a job's open tasks on the worker pool and checkpoints every step.

Each worker gets `batch.max_sequences` tasks at a time (one feeding thread each; the worker batches
their sequences), the longest expected task first, to the worker with the least expected work in
flight (jobs/balance.py: long documents must not straggle at the end, nor pile up on one worker). Each
task runs under one tenacity policy for transient failures (I/O error, worker died, timeout); a
task whose worker died or hung goes back to the front of the shared queue, so any worker (on any
node) takes it while the lost one restarts. A loss while batch-mates shared the worker is not held
against a task until it has run alone. When a context size keeps failing, or the worker's cache
ladder is exhausted, the task is tried again with a shorter context. A result row in results/ is
the only "done" record, so a coordinator killed at any instant loses at most the tasks in flight.
The coordinator, holding the job's lock, is the only writer of the job folder: the passes a worker
finishes come back to it and go into the checkpoint log (storage/passes.py), and every attempt at a
task is handed the passes kept so far, read back from the job folder on a resume.

Ray lives in the pool (runner/pool.py), the recording of events and results in the recorder
(runner/recorder.py); this module keeps the work queue and the retry loop.
"""

from __future__ import annotations

import heapq
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    wait_exponential,
)
from tenacity.stop import stop_base

from jobs.balance import expected_decode_tokens, expected_passes, expected_work, may_take, merge_work, pass_work
from jobs.config import JobConfig, RetryConfig
from jobs.faults import FaultRule
from jobs.outcome import DealtPass, TaskOutcome, with_dealt_passes
from jobs.policy import FINAL_CLASSES, FailureClass, context_fallback_note, shorter_context
from jobs.task import Task
from runner.node_sweeper import NodeSweeper
from runner.observe.alerts import AlertMonitor
from runner.observe.joblog import JobLog
from runner.observe.metrics import BatchMetrics
from runner.observe.progress import BatchProgress
from runner.pool import (
    WORKER_RESTART_TIMEOUT_S,
    PoolStopped,
    TransientFailure,
    Worker,
    WorkerLost,
    WorkerPool,
    WorkersNotStarted,
    WorkerStartError,
)
from runner.recorder import TaskRecorder
from storage.checkpoint import CheckpointLog
from storage.jobdir import JobDir
from storage.lease import LeaseLostError
from storage.location import no_fence
from storage.lock import HeldLock
from storage.passes import PassRow, read_passes, remove_passes, tasks_with_passes

EXIT_OK = 0
EXIT_FAILED_TASKS = 3
EXIT_NO_WORKERS = 4
EXIT_LEASE_LOST = 5
EXIT_INTERRUPTED = 130
#: A task whose worker was lost this often while other tasks shared it runs alone from then on, and
#: only then do losses count as its own attempts: a poison document must not use up its batch-mates'.
BATCH_LOSSES_BEFORE_ALONE = 2


class Interrupted(Exception):
    """The user asked the batch to stop; the task is left for `resume`."""


@dataclass(eq=False)  # a task's record, compared by identity
class TaskRun:
    """One task's progress through the batch: attempts, context size, fallbacks so far."""

    task: Task
    attempt: int = 0
    context_tokens: int = 0
    tries_at_context: int = 0  # its own attempts at the current context size, on whichever workers (a
    # loss while batch-mates shared the worker is not one of them, until it runs alone)
    fallbacks: list[str] = field(default_factory=list)
    queue_wait_s: float | None = None
    slow_alerted: bool = False
    batch_losses: int = 0  # worker losses while batch-mates were in flight: not counted as its attempts
    alone: bool = False  # after BATCH_LOSSES_BEFORE_ALONE of those, it runs with no batch-mates
    passes: dict[str, PassRow] = field(default_factory=dict)  # by key: finished passes, handed to each attempt
    dealt_at: int = 0  # the context its first level was dealt out at (0: not yet)
    dealt_chunks: int = 0  # its chunks when they were dealt out (0: not dealt): then only its merges are left
    passes_out: int = 0  # its passes dealt out and not ended yet: the task waits out of the queue until none is
    dealt: set[str] = field(default_factory=set)  # keys of the passes dealt out for its next attempt, which
    # counts them (their timings, from their rows) as its own, not reused
    dealt_outcomes: list[TaskOutcome] = field(default_factory=list)  # of those passes: their cache figures


@dataclass(eq=False)
class PassRun:
    """One pass of a task's first level, dealt out to whichever worker has room: a long document's chunks
    run on every worker at once. It runs once, on its worker's cache ladder; a pass that fails or whose
    worker is lost is left to the task's own attempt, which retries, moves down the ladder and falls back
    to a shorter context as it does for any pass."""

    run: TaskRun
    dealt: DealtPass


Work = TaskRun | PassRun
"""What a feeding thread takes from the queue."""


def work_of(item: Work, config: JobConfig) -> float:
    """The work `item` is expected to take: a pass's own, a task's at its context (only its merges once
    its chunks were dealt out)."""
    if isinstance(item, PassRun):
        return pass_work(item.run.task, config, len(item.dealt.prompt))
    if item.dealt_chunks and item.dealt_at == item.context_tokens:
        return merge_work(item.task, config, item.dealt_chunks, item.context_tokens)
    return expected_work(item.task, config, item.context_tokens)


class TaskEnd(Enum):
    """How `Coordinator._run_task` left a task, which says what its feeding thread does next."""

    FINISHED = "finished"  # its result row is written
    WORKER_LOST = "worker lost"  # its result row is written, but its worker was lost on the way: the task
    # holds the batch open until the worker is back (the restart sweeps the dead process's scratch dir)
    HANDED_BACK = "handed back"  # its worker was lost and the task goes on: back to the queue, for any worker


class attempts_at_context_reach(stop_base):  # noqa: N801 - named like tenacity's own stops
    """Stop once the task has had `limit` attempts at its current context size, on any worker (a task
    handed to another worker keeps its count; a shorter context starts a new one)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, retry_state: RetryCallState) -> bool:
        run: TaskRun = retry_state.args[-1]
        return run.tries_at_context >= self.limit


def task_retrying(retry: RetryConfig, before_sleep: Any, sleep: Any) -> Retrying:
    """The transient-failure policy, built once: exponential backoff, a lost worker never waited for
    here (its task goes back to the queue), `retry.max_attempts` attempts per context size."""
    return Retrying(
        stop=attempts_at_context_reach(retry.max_attempts),
        wait=wait_exponential(multiplier=retry.backoff_initial_s, min=retry.backoff_initial_s,
                              max=retry.backoff_max_s),
        retry=retry_if_exception_type(TransientFailure) & retry_if_not_exception_type(WorkerLost),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )


class TaskQueue:
    """Open tasks, the longest expected first, shared by the feeding threads; a task handed back by a
    lost worker goes in front, with its work at its (maybe shorter) context, and so do the passes a task
    deals out (it waits out of the queue until they have ended, then goes in front for its merges). A
    worker takes the next item only while no other worker with a free slot has less expected work in
    flight, so the long documents spread over the workers instead of one worker's queue setting the
    batch's end. `take` waits while other threads still hold items that may bring work back."""

    def __init__(self, runs: list[TaskRun], work_of: Callable[[Work], float], workers: list[Worker],
                 slots: int, is_down: Callable[[Worker], bool]) -> None:
        self._order = itertools.count()
        self._work_of = work_of
        self._heap = [self._entry(1, run) for run in runs]
        heapq.heapify(self._heap)
        self._held: dict[Worker, list[Work]] = {w: [] for w in workers}
        self._slots = slots
        self._is_down = is_down
        self._changed = threading.Condition()

    def _entry(self, priority: int, item: Work) -> tuple[int, float, int, Work]:
        return priority, -self._work_of(item), next(self._order), item

    def _load(self, worker: Worker) -> float:
        return sum(self._work_of(run) for run in self._held[worker])

    @contextmanager
    def taking(self, worker: Worker, stop: threading.Event) -> Iterator[Work | None]:
        """The next item for `worker`, held by it until the block ends or it is handed back or dealt out;
        None once none is left and none can come back (or the batch stops)."""
        run = self._take(worker, stop)
        try:
            yield run
        finally:
            if run is not None:
                self._release(worker, run)

    def _take(self, worker: Worker, stop: threading.Event) -> Work | None:
        with self._changed:
            while not stop.is_set():
                if self._heap:
                    free = [w for w, held in self._held.items() if len(held) < self._slots and not self._is_down(w)]
                    if may_take(worker, {w: self._load(w) for w in self._held}, free):
                        run = heapq.heappop(self._heap)[-1]
                        self._held[worker].append(run)
                        self._changed.notify_all()
                        return run
                elif not any(self._held.values()):
                    return None
                self._changed.wait(0.2)
            return None

    def load(self, worker: Worker) -> float:
        """The expected work of the tasks `worker` holds now."""
        with self._changed:
            return self._load(worker)

    def room(self, worker: Worker) -> int:
        """How many more items `worker` may hold now."""
        with self._changed:
            return self._slots - len(self._held[worker])

    def _release(self, worker: Worker, item: Work) -> None:
        with self._changed:
            if item in self._held[worker]:  # not handed back nor dealt out
                self._held[worker].remove(item)
            if isinstance(item, PassRun):
                item.run.passes_out -= 1
                if not item.run.passes_out:  # its last pass dealt out ended: on to its merges, in front
                    heapq.heappush(self._heap, self._entry(0, item.run))
            self._changed.notify_all()

    def deal(self, worker: Worker, run: TaskRun, passes: list[DealtPass], chunks: int) -> None:
        """`run`'s `passes` (of its `chunks`) go in front of the queue, for any worker; `run` waits until
        they have ended, then comes back with only its merges' work."""
        with self._changed:
            self._held[worker].remove(run)
            run.dealt_chunks = chunks
            run.passes_out = len(passes)
            for dealt in passes:
                heapq.heappush(self._heap, self._entry(0, PassRun(run, dealt)))
            self._changed.notify_all()

    def hand_back(self, worker: Worker, run: TaskRun) -> None:
        """Another worker takes `run` on now (in front of the queue); `worker` no longer holds it."""
        with self._changed:
            heapq.heappush(self._heap, self._entry(0, run))
            self._held[worker].remove(run)
            self._changed.notify_all()

    def drained(self) -> bool:
        """Nothing left to run and nothing in flight that could come back."""
        with self._changed:
            return not self._heap and not any(self._held.values())

    def left(self) -> int:
        """Tasks not run (a task whose passes wait in the queue counted once)."""
        with self._changed:
            return len({item.run if isinstance(item, PassRun) else item for *_, item in self._heap})


def _transient_failure(e: TransientFailure) -> TaskOutcome:
    """The outcome of a task whose transient failures used up its attempts at a context size."""
    return TaskOutcome(status="failed", failure_class=FailureClass.TRANSIENT.value, error_type=e.error_type,
                       error=str(e))


class Coordinator:
    def __init__(self, job: JobDir, job_id: str, config: JobConfig, offload_root: Path,
                 faults: list[FaultRule], console: Console, lock: HeldLock | None = None) -> None:
        """`lock` is the job lock held for this run: every write into the job folder is fenced with
        it, and the batch stops once it is lost (a lease another coordinator took over)."""
        self.cfg = config
        self.offload_root = offload_root
        self.console = console
        self.lock = lock
        fence = self._fence = lock.check if lock is not None else no_fence
        self.stop = threading.Event()
        self.log = JobLog(job.log, fence)
        self.alerts = AlertMonitor(self.log, console)
        self.job = job
        checkpoint = self.checkpoint = CheckpointLog(job.path, flush_every=config.checkpoint.flush_every,
                                   flush_interval_s=config.checkpoint.flush_interval_s, fence=fence,
                                   after_results=self._drop_passes)
        self.recorder = TaskRecorder(checkpoint, self.log, self.alerts, BatchMetrics(job_id), self.stop)
        self.pool = WorkerPool(config, job_id, offload_root, faults, self.log)
        self.retrying = task_retrying(config.retry, self._before_retry, self._sleep)
        self._queued_at = time.time()

    def _drop_passes(self, task_ids: list[str]) -> None:
        """A document's passes go once its result is published; if this fails the next run's sweep takes them."""
        try:
            remove_passes(self.job.path, task_ids, self._fence)
        except OSError as e:
            self.log.warning("passes_not_removed", tasks=len(task_ids), error=str(e))

    def _read_passes(self, runs: list[TaskRun]) -> None:
        """The passes kept by an earlier run, for the open tasks' attempts; those of tasks that have
        ended (a crash came between their result and the passes' removal) go. A folder that cannot
        be read only costs its passes, which run again."""
        by_id = {run.task.task_id: run for run in runs}
        try:
            with_passes = tasks_with_passes(self.job.path)
        except OSError as e:
            self.log.warning("passes_not_listed", error=str(e))
            return
        self._drop_passes([task_id for task_id in with_passes if task_id not in by_id])
        for task_id in with_passes:
            if (run := by_id.get(task_id)) is not None:
                try:
                    run.passes = {row["key"]: row for row in read_passes(self.job.path, task_id)}
                except OSError as e:
                    self.log.warning("passes_not_read", task_id=task_id, error=str(e))

    def _passes_back(self, run: TaskRun, rows: list[PassRow]) -> None:
        """Passes a worker finished for `run`: kept for its next attempt and in the job folder."""
        if rows:
            run.passes.update((row["key"], row) for row in rows)
            self.checkpoint.add_passes(rows)
        for row in rows:
            self.log.info("pass_kept", task_id=row["task_id"], doc_id=row["doc_id"], level=row["level"],
                          index=row["index"], worker=row["worker"], finished_at=row["finished_at"],
                          prefill_s=row["prefill_s"], decode_s=row["decode_s"], new_tokens=len(row["tokens"]))

    # -- one attempt ----------------------------------------------------------------------------
    def _attempt(self, worker: Worker, run: TaskRun) -> TaskOutcome:
        if self.stop.is_set():
            raise Interrupted()
        run.attempt += 1
        if run.queue_wait_s is None:
            run.queue_wait_s = time.time() - self._queued_at
        slot = self.pool.slot_name(worker)
        self.recorder.started(run.task, run.attempt, run.context_tokens, slot)
        own = True  # whether the attempt counts against the task
        try:
            outcome = self.pool.run(worker, run.task, run.attempt, run.context_tokens, run.alone,
                                    list(run.passes.values()), lambda rows: self._passes_back(run, rows), run.dealt)
        except PoolStopped:
            raise Interrupted() from None
        except WorkerLost as lost:
            if self.stop.is_set():
                raise Interrupted() from None
            own = self._lost(slot, run, lost)
            raise
        finally:
            run.dealt = set()  # the attempt counted them as its own: the next one reuses them
            run.slow_alerted = self.recorder.stopped(run.task)
            if own:
                run.tries_at_context += 1
        if outcome.get("failure_class") == FailureClass.TRANSIENT:
            raise TransientFailure(outcome["error_type"], outcome["error"])
        return outcome

    def _lost(self, slot: str, run: TaskRun, lost: WorkerLost) -> bool:
        """Records a lost worker; whether the loss is the task's own (not one shared with batch-mates
        before it ran alone)."""
        if lost.first_to_see:  # one loss, however many tasks it ended; a document is blamed only when it was alone
            self.recorder.worker_lost(slot, lost.error_type, None if lost.shared else run.task.doc_id)
        if not lost.shared or run.alone:
            return True
        run.batch_losses += 1
        run.alone = run.batch_losses >= BATCH_LOSSES_BEFORE_ALONE
        self.log.warning("task_lost_in_batch", task_id=run.task.task_id, doc_id=run.task.doc_id,
                         losses=run.batch_losses, runs_alone_next=run.alone)
        return False

    def _before_retry(self, state: RetryCallState) -> None:
        run: TaskRun = state.args[-1]
        err = state.outcome.exception() if state.outcome else None
        self._note_retry(run, err, state.upcoming_sleep)

    def _note_retry(self, run: TaskRun, err: BaseException | None, sleep_s: float) -> None:
        error_type = getattr(err, "error_type", type(err).__name__)
        self.recorder.retry(run.task, run.attempt, run.context_tokens, error_type, str(err), sleep_s)

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Interrupted()

    # -- one dealt pass -------------------------------------------------------------------------
    def _deal(self, worker: Worker, run: TaskRun, work: TaskQueue) -> bool:
        """Deals a task's first level out (once per context, with two workers or more) when more of its
        chunks are not kept yet than its worker has slots for: they go to the front of the queue, one pass
        each, for whichever worker has room. Returns whether it did."""
        if run.dealt_at == run.context_tokens or len(self.pool.workers) < 2:  # one worker batches its chunks anyway
            return False
        if len(expected_passes(run.task, self.cfg, run.context_tokens)) == 1:  # no call to plan what fits one pass
            return False
        run.dealt_at = run.context_tokens
        passes = self.pool.first_level(worker, run.task, run.context_tokens)
        left = [dealt for dealt in passes if dealt.key not in run.passes]
        if len(left) <= work.room(worker) + 1:  # they fit its worker's batch: the task's own slot and the free ones
            return False
        if run.queue_wait_s is None:
            run.queue_wait_s = time.time() - self._queued_at
        self.log.info("task_dealt", task_id=run.task.task_id, doc_id=run.task.doc_id, context_tokens=run.context_tokens,
                      chunks=len(passes), dealt=len(left))
        work.deal(worker, run, left, len(passes))
        return True

    def _run_pass(self, worker: Worker, item: PassRun) -> None:
        """Runs one dealt pass; what it finishes is kept for its task, what stops it is the task's to meet."""
        if self.stop.is_set():
            raise Interrupted()
        run, dealt = item.run, item.dealt
        self.log.info("pass_assigned", task_id=run.task.task_id, doc_id=run.task.doc_id, index=dealt.index,
                      worker=self.pool.slot_name(worker))
        try:
            outcome = self.pool.run(worker, run.task, run.attempt, run.context_tokens, False, [],
                                    lambda rows: self._passes_back(run, rows), dealt_pass=dealt)
        except PoolStopped:
            raise Interrupted() from None
        except WorkerLost as lost:
            if self.stop.is_set():
                raise Interrupted() from None
            if lost.first_to_see:
                self.recorder.worker_lost(self.pool.slot_name(worker), lost.error_type, None)
            outcome = _transient_failure(lost)
        if outcome["status"] == "done":
            run.dealt.add(dealt.key)
            run.dealt_outcomes.append(outcome)
        else:
            self.log.warning("dealt_pass_failed", task_id=run.task.task_id, doc_id=run.task.doc_id, index=dealt.index,
                             error_type=outcome["error_type"], error=outcome["error"],
                             hint="the task's own attempt runs it")

    # -- one task -------------------------------------------------------------------------------
    def _finish(self, run: TaskRun, outcome: TaskOutcome) -> None:
        run.passes = {}  # its result is the record now
        if outcome["status"] == "done":
            outcome = with_dealt_passes(outcome, run.dealt_outcomes)
        self.recorder.finish(run.task, run.attempt, run.context_tokens, run.fallbacks, run.queue_wait_s,
                             run.slow_alerted, outcome)

    def _run_task(self, worker: Worker, run: TaskRun) -> TaskEnd:
        """Runs `run`, at shorter contexts while its ladder fails, until it ends or its worker is lost
        and another worker must take it on."""
        while True:
            lost = False
            try:
                outcome = self.retrying.copy()(self._attempt, worker, run)
            except WorkerLost as e:
                if run.tries_at_context < self.cfg.retry.max_attempts:
                    self._note_retry(run, e, 0.0)
                    return TaskEnd.HANDED_BACK
                outcome, lost = _transient_failure(e), True
            except TransientFailure as e:
                outcome = _transient_failure(e)
            smaller = self._shorter_context(run, outcome)
            if smaller is None:
                self._finish(run, outcome)
                return TaskEnd.WORKER_LOST if lost else TaskEnd.FINISHED
            self._fall_back(run, outcome, smaller)
            if lost:  # the shorter context goes to whichever worker is free
                return TaskEnd.HANDED_BACK

    def _shorter_context(self, run: TaskRun, outcome: TaskOutcome) -> int | None:
        """The context to try next, or None when the task ends with `outcome`: it is done, it failed in
        a way a shorter context cannot fix, or the context is as short as it may be."""
        if outcome["status"] == "done" or outcome["failure_class"] in FINAL_CLASSES:
            return None
        return shorter_context(run.context_tokens, self.cfg.retry.context_shrink, self.cfg.summarize.min_context_tokens)

    def _fall_back(self, run: TaskRun, outcome: TaskOutcome, smaller: int) -> None:
        """The task goes on at `smaller` tokens: the failed attempt's cache moves and this move join its
        fallbacks, and its attempts at the new size start from none."""
        run.fallbacks.extend(outcome.get("fallbacks", []))
        run.fallbacks.append(context_fallback_note(run.context_tokens, smaller, outcome["error_type"]))
        self.recorder.context_fallback(run.task, run.attempt, run.context_tokens, smaller,
                                       outcome["error_type"], outcome["error"])
        run.context_tokens = smaller
        run.tries_at_context = 0

    def _feed(self, worker: Worker, work: TaskQueue, errors: list[BaseException]) -> None:
        """One of a worker's feeding threads: takes tasks until none is left (while its worker is down
        after a loss, it waits for the worker rather than take a task the worker cannot run, and stops
        waiting once nothing is left that it could run)."""
        while True:
            if self.pool.is_down(worker) and not self._await_restart(worker, errors, until_drained=work):
                return
            with work.taking(worker, self.stop) as item:
                if item is None:
                    return
                try:
                    if isinstance(item, PassRun):
                        self._run_pass(worker, item)
                        continue
                    run = item
                    if self._deal(worker, run, work):
                        continue
                    self.log.info("task_assigned", task_id=run.task.task_id, doc_id=run.task.doc_id,
                                  worker=self.pool.slot_name(worker), context_tokens=run.context_tokens,
                                  expected_work=round(work_of(run, self.cfg)), worker_work=round(work.load(worker)))
                    end = self._run_task(worker, run)
                except Interrupted:
                    return
                except WorkerStartError as e:  # the restart this task's call waited for raised (the pool's own wait)
                    self._stop_on_restart_error(worker, e, errors)
                    return
                except BaseException as e:  # a bug must stop the batch loudly, not hang it
                    errors.append(e)
                    self.stop.set()
                    return
                if end is TaskEnd.HANDED_BACK:
                    work.hand_back(worker, run)  # another worker takes it now; this one waits for its restart

    def _stop_on_restart_error(self, worker: Worker, e: WorkerStartError, errors: list[BaseException]) -> None:
        """A restarted worker's start raised: the batch stops with that error, whichever thread saw it."""
        self.log.warning("worker_restart_failed", worker=self.pool.slot_name(worker), error=str(e))
        errors.append(e)
        self.stop.set()

    def _await_restart(self, worker: Worker, errors: list[BaseException],
                       until_drained: TaskQueue | None = None) -> bool:
        """Whether the worker is back; a restart whose start raised stops the batch with that error."""
        def give_up() -> bool:
            return self.stop.is_set() or (until_drained is not None and until_drained.drained())

        try:
            back = self.pool.await_restart(worker, give_up)
        except WorkerStartError as e:
            self._stop_on_restart_error(worker, e, errors)
            return False
        if not back and not give_up():
            self.log.warning("worker_restart_unfinished", worker=self.pool.slot_name(worker),
                             hint="no capacity left for it; a killed worker's scratch dir is swept "
                             "when its node comes back, or by `kvbatch clean` there")
        return back

    # -- the batch ------------------------------------------------------------------------------
    def run(self, open_tasks: list[Task], already_done: int, total: int) -> int:
        """Runs the open tasks to an end; returns the exit code (0, 4 or 130)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run(open_tasks, already_done, total)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.log.close()

    def _run(self, open_tasks: list[Task], already_done: int, total: int) -> int:
        context = self.cfg.summarize.context_tokens
        runs = [TaskRun(task=task, context_tokens=context) for task in open_tasks]
        self._read_passes(runs)
        count = self.pool.worker_count(len(open_tasks))
        self.log.info("batch_start", open_tasks=len(open_tasks), workers=count,
                      sequences_per_worker=self.cfg.batch.sequences)
        try:
            infos = self.pool.start(count, self.stop.is_set) if open_tasks else []
        except (PoolStopped, WorkersNotStarted, WorkerStartError) as e:
            self.recorder.close()
            return self._not_started(e)
        for info in infos:
            self.log.info("worker_ready", **info)
        if 0 < len(infos) < count:
            self.log.warning("workers_not_started", started=len(infos), wanted=count,
                             hint=f"the rest did not start within workers.start_timeout_s="
                                  f"{self.cfg.workers.start_timeout_s:g} s")
        self._queued_at = time.time()  # queue wait counts from here: waiting for a free worker
        errors: list[BaseException] = []
        workers = self.pool.workers
        work = TaskQueue(runs, lambda item: work_of(item, self.cfg), workers, self.cfg.batch.sequences,
                         self.pool.is_down)
        budgets = {run.task.task_id: expected_decode_tokens(run.task, self.cfg) for run in runs}
        with self.alerts.watching(), NodeSweeper(self.offload_root, self.log), \
                BatchProgress(self.console, total, already_done, len(workers), budgets, self.alerts.busy_workers,
                              self.pool.tokens_decoded, self.log) as progress:
            self.recorder.progress = progress
            # as many tasks in flight per worker as it batches sequences, so its batch stays full; the
            # queue deals each task to the least loaded worker, so a short queue is shared out evenly
            threads = [threading.Thread(target=self._feed, args=(w, work, errors), daemon=True)
                       for _ in range(self.cfg.batch.sequences) for w in workers]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads) and not self.stop.is_set():
                for t in threads:
                    t.join(timeout=0.2)
                if self.lock is not None and self.lock.lost:
                    self.stop.set()
            if self.stop.is_set():
                self._abandon_in_flight(threads)
            else:  # a worker still down is not waited for (its restart would load the model for nothing)
                self._name_survivors(self.pool.kill_down())
        try:
            self.recorder.close()
        except LeaseLostError as e:
            errors.append(e)
        if (lease_lost := self._lease_lost(errors)) is not None:
            self.log.warning("lease_lost", error=str(lease_lost))
            self.console.print(f"[red]{escape(str(lease_lost))}")
            return EXIT_LEASE_LOST
        if errors:
            raise errors[0]
        if self.stop.is_set():
            self.log.warning("batch_interrupted")
            return EXIT_INTERRUPTED
        if left := work.left():
            self.log.warning("batch_stalled", tasks_left=left)
            self.console.print(f"[red]{left} task(s) not run: every worker was lost and none came back "
                               f"within {WORKER_RESTART_TIMEOUT_S:.0f} s (no capacity left on the cluster)")
            return EXIT_NO_WORKERS
        self.log.info("batch_end")
        return EXIT_OK

    def _not_started(self, e: Exception) -> int:
        """The exit code when the workers did not start; a worker's own error is the job's config error."""
        if isinstance(e, PoolStopped):
            self.log.warning("batch_interrupted", during="worker start")
            return EXIT_INTERRUPTED
        self.log.warning("workers_not_started", error=str(e))
        if isinstance(e, WorkerStartError):
            raise e
        self.console.print(f"[red]{escape(str(e))}")
        return EXIT_NO_WORKERS

    def _name_survivors(self, still_alive: list[str]) -> None:
        """Killed workers' processes still alive: the batch's last sweep, which runs once they are gone,
        cannot remove their task dirs."""
        if still_alive:
            self.log.warning("workers_not_gone", processes=still_alive,
                             hint="their scratch dirs stay until `kvbatch clean` runs after they exit")

    def _abandon_in_flight(self, threads: list[threading.Thread]) -> None:
        """Killing the workers ends every pending call at once, so no thread outlives the batch."""
        self._name_survivors(self.pool.kill_all())
        for t in threads:
            t.join(timeout=30)

    def _lease_lost(self, errors: list[BaseException]) -> LeaseLostError | None:
        lost = next((e for e in errors if isinstance(e, LeaseLostError)), None)
        if lost is None and self.lock is not None and self.lock.lost:
            try:
                self.lock.check()
            except LeaseLostError as e:
                lost = e
        return lost

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop.is_set():
            self.console.print("[red]second interrupt: exiting now (the job is still resumable)")
            os._exit(EXIT_INTERRUPTED)
        self.stop.set()
        self.console.print(
            f"[yellow]{signal.Signals(signum).name}: stopping; tasks in flight are abandoned and will "
            "rerun on resume (interrupt again to exit at once)"
        )
