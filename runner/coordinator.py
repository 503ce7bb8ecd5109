"""The coordinator: runs a job's open documents on the worker pool and checkpoints every pass.

Each document is a `DocumentRun` (jobs/document_run.py): planned by a worker (its chunks), its passes
dealt to any worker through one `WorkQueue` (jobs/balance.py: the longest document first, a pass to
the worker holding its document's other passes when it may take it, to the least loaded otherwise),
each pass's row kept in the job folder the moment it comes back (storage/passes.py), before anything
that depends on it is dealt; the next level is planned from the kept summaries, until one is left. So
a coordinator killed at any instant loses only the passes in flight, and the result row in results/
is the only "done" record. Every call runs under one tenacity policy for transient failures (I/O
error, timeout); a call whose worker died or hung goes back to the front of the queue, for any worker
(on any node) while the lost one restarts. A loss while batch-mates shared the worker is not held
against a document until its passes run alone. When a context keeps failing, or a worker's cache
ladder runs out, the document starts over at a shorter context, keeping every pass kept so far. The
coordinator, holding the job's lock, is the only writer of the job folder.

Ray lives in the pool (runner/pool.py), the recording of events and results in the recorder
(runner/recorder.py); this module keeps the work queue and the retry loop.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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

from jobs.balance import WorkQueue, expected_decode_tokens, expected_work, pass_work
from jobs.config import JobConfig, RetryConfig
from jobs.document_run import DocumentRun, Stage
from jobs.faults import FaultRule
from jobs.outcome import CallOutcome, TaskOutcome, fold_passes
from jobs.passes import PassSpec
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
from storage.passes import read_passes, remove_passes, tasks_with_passes

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


class Unwanted(Exception):
    """The call's work is no longer wanted: its document moved to a shorter context or ended."""


@dataclass(eq=False)
class Planning:
    """A work item: a document whose first level needs a plan."""

    doc: DocumentRun
    work: float

    def run(self, coordinator: Coordinator, worker: Worker) -> None:
        coordinator.plan(worker, self.doc)


@dataclass(eq=False)
class Pass:
    """A work item: one pass of a document."""

    doc: DocumentRun
    spec: PassSpec
    work: float

    def run(self, coordinator: Coordinator, worker: Worker) -> None:
        coordinator.run_pass(worker, self)


class attempts_at_context_reach(stop_base):  # noqa: N801 - named like tenacity's own stops
    """Stop once the document's calls have failed `limit` times at its current context size, on any worker
    (a call handed to another worker keeps its count; a shorter context starts a new one)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, retry_state: RetryCallState) -> bool:
        doc: DocumentRun = retry_state.args[0]
        return doc.tries_at_context >= self.limit


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


def _transient_failure(e: TransientFailure) -> CallOutcome:
    """The outcome of a call whose transient failures used up its document's attempts at a context size."""
    return CallOutcome(status="failed", failure_class=FailureClass.TRANSIENT.value, error_type=e.error_type,
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
        self._lock = threading.RLock()  # the documents' states: several feeding threads run one's passes
        self.work: WorkQueue

    def _drop_passes(self, task_ids: list[str]) -> None:
        """A document's passes go once its result is published; if this fails the next run's sweep takes them."""
        try:
            remove_passes(self.job.path, task_ids, self._fence)
        except OSError as e:
            self.log.warning("passes_not_removed", tasks=len(task_ids), error=str(e))

    def _read_passes(self, docs: list[DocumentRun]) -> None:
        """The passes kept by an earlier run, for the open documents; those of documents that have ended
        (a crash came between their result and the passes' removal) go. A folder that cannot be read
        only costs its passes, which run again."""
        by_id = {doc.task.task_id: doc for doc in docs}
        try:
            with_passes = tasks_with_passes(self.job.path)
        except OSError as e:
            self.log.warning("passes_not_listed", error=str(e))
            return
        self._drop_passes([task_id for task_id in with_passes if task_id not in by_id])
        for task_id in with_passes:
            if (doc := by_id.get(task_id)) is not None:
                try:
                    doc.kept = {row["key"]: row for row in read_passes(self.job.path, task_id)}
                except OSError as e:
                    self.log.warning("passes_not_read", task_id=task_id, error=str(e))

    # -- the work items ---------------------------------------------------------------------------
    def plan(self, worker: Worker, doc: DocumentRun) -> None:
        """Plans the document's next level on `worker` and deals its passes (a level whose passes were all
        kept before goes on to the next at once); a lost worker hands the planning to any other."""
        while True:
            with self._lock:
                if not (doc.stage is Stage.PLANNING and doc.claim()):
                    return
                level, parts, context = doc.level, list(doc.parts), doc.context_tokens
            if level == 0:
                self.log.info("task_assigned", task_id=doc.task.task_id, doc_id=doc.task.doc_id,
                              worker=self.pool.slot_name(worker), context_tokens=context,
                              expected_work=round(expected_work(doc.task, self.cfg, context)),
                              worker_work=round(self.work.load(worker)))
                call = lambda: self.pool.plan(worker, doc.task, context, doc.alone)  # noqa: E731
            else:
                call = lambda: self.pool.plan_merge(worker, doc.task, level, parts, context, doc.alone)  # noqa: E731
            outcome = self._call(worker, doc, call, lambda: doc.context_tokens == context,
                                 Planning(doc, expected_work(doc.task, self.cfg, context)))
            if outcome is None:  # handed back, or no longer wanted
                with self._lock:
                    doc.unclaim()
                return
            if outcome["status"] != "done":
                self._failed(doc, outcome)
                return
            with self._lock:
                if doc.context_tokens != context or doc.ended:
                    return
                doc.planned(outcome["plan"])
                passes = [Pass(doc, spec, pass_work(doc.task, self.cfg, len(spec.prompt))) for spec in doc.next_passes()]
                done = doc.stage is Stage.DONE and doc.claim()
            self.work.put(passes)
            if done:
                self._finish(doc)
                return

    def run_pass(self, worker: Worker, item: Pass) -> None:
        """Runs one pass; its row is kept before anything that depends on it is dealt."""
        doc, spec = item.doc, item.spec
        with self._lock:
            if not doc.wants(spec):
                return
        self.log.info("pass_assigned", task_id=spec.task_id, doc_id=spec.doc_id, level=spec.level, index=spec.index,
                      context_tokens=spec.context_tokens, worker=self.pool.slot_name(worker))
        outcome = self._call(worker, doc, lambda: self.pool.run_pass(worker, spec, doc.attempt, doc.alone),
                             lambda: doc.wants(spec), item)
        if outcome is None:
            return
        if outcome["status"] != "done":
            with self._lock:
                doc.pass_ended(spec)
                wanted = doc.wants(spec)
            if wanted:
                self._failed(doc, outcome)
            return
        row = outcome["row"]
        if doc.ended:  # its result is the record now
            return
        self.checkpoint.add_passes([row])  # durable before anything that depends on it
        self.log.info("pass_kept", task_id=row["task_id"], doc_id=row["doc_id"], level=row["level"],
                      index=row["index"], worker=row["worker"], finished_at=row["finished_at"],
                      prefill_s=row["prefill_s"], decode_s=row["decode_s"], new_tokens=len(row["tokens"]))
        with self._lock:
            doc.pass_done(row, outcome)
            stage = doc.stage
        if stage is Stage.PLANNING:
            self.plan(worker, doc)  # the next level, on the worker that ran the level's last pass
        elif stage is Stage.DONE:
            with self._lock:
                done = doc.claim()
            if done:
                self._finish(doc)

    # -- one call ---------------------------------------------------------------------------------
    def _call(self, worker: Worker, doc: DocumentRun, call: Callable[[], CallOutcome], wanted: Callable[[], bool],
              again: Planning | Pass) -> CallOutcome | None:
        """The call's outcome after transient failures were retried (a failed one when they used up the
        document's attempts); None when it was handed back to the queue (`again`: for any worker) or
        its work is no longer wanted."""
        try:
            return self.retrying.copy()(self._attempt, doc, worker, call, wanted)
        except Unwanted:
            return None
        except WorkerLost as e:
            if doc.tries_at_context < self.cfg.retry.max_attempts:
                self._note_retry(doc, e, 0.0)
                self.work.put([again])
                return None
            return _transient_failure(e)
        except TransientFailure as e:
            return _transient_failure(e)

    def _attempt(self, doc: DocumentRun, worker: Worker, call: Callable[[], CallOutcome],
                 wanted: Callable[[], bool]) -> CallOutcome:
        if self.stop.is_set():
            raise Interrupted()
        with self._lock:
            if not wanted():
                raise Unwanted()
            doc.begin()
            if doc.queue_wait_s is None:
                doc.queue_wait_s = time.time() - self._queued_at
            doc.calls += 1
            first = doc.calls == 1
        slot = self.pool.slot_name(worker)
        if first:
            self.recorder.started(doc.task, doc.attempt, doc.context_tokens, slot)
        failed = own = True
        try:
            outcome = call()
            failed = outcome["status"] != "done"
        except PoolStopped:
            raise Interrupted() from None
        except WorkerLost as lost:
            if self.stop.is_set():
                raise Interrupted() from None
            own = self._lost(slot, doc, lost)
            raise
        finally:
            with self._lock:
                doc.calls -= 1
                last = doc.calls == 0
                if failed:
                    doc.call_failed(own)
            if last:
                doc.slow_alerted |= self.recorder.stopped(doc.task)
        if outcome.get("failure_class") == FailureClass.TRANSIENT:
            raise TransientFailure(outcome["error_type"], outcome["error"])
        return outcome

    def _lost(self, slot: str, doc: DocumentRun, lost: WorkerLost) -> bool:
        """Records a lost worker; whether the loss is the document's own (not one shared with batch-mates
        before its passes ran alone)."""
        if lost.first_to_see:  # one loss, however many calls it ended; a document is blamed only when it was alone
            self.recorder.worker_lost(slot, lost.error_type, None if lost.shared else doc.task.doc_id)
        if not lost.shared or doc.alone:
            return True
        with self._lock:
            doc.batch_losses += 1
            doc.alone = doc.batch_losses >= BATCH_LOSSES_BEFORE_ALONE
        self.log.warning("task_lost_in_batch", task_id=doc.task.task_id, doc_id=doc.task.doc_id,
                         losses=doc.batch_losses, runs_alone_next=doc.alone)
        return False

    def _before_retry(self, state: RetryCallState) -> None:
        doc: DocumentRun = state.args[0]
        err = state.outcome.exception() if state.outcome else None
        self._note_retry(doc, err, state.upcoming_sleep)

    def _note_retry(self, doc: DocumentRun, err: BaseException | None, sleep_s: float) -> None:
        error_type = getattr(err, "error_type", type(err).__name__)
        self.recorder.retry(doc.task, doc.attempt, doc.context_tokens, error_type, str(err), sleep_s)

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Interrupted()

    # -- a document's end -------------------------------------------------------------------------
    def _failed(self, doc: DocumentRun, outcome: CallOutcome) -> None:
        """A call failed for good at this context: the document starts over at a shorter one (a new
        Planning item), or ends failed when it cannot (done, final class, shortest context)."""
        with self._lock:
            if doc.ended:
                return
            smaller = (None if outcome["failure_class"] in FINAL_CLASSES else
                       shorter_context(doc.context_tokens, self.cfg.retry.context_shrink,
                                       self.cfg.summarize.min_context_tokens))
            if smaller is None:
                doc.fail()
            else:
                before = doc.context_tokens
                doc.fallbacks.extend(outcome.get("fallbacks", []))
                doc.fall_back(smaller, context_fallback_note(before, smaller, outcome["error_type"]))
        if smaller is None:
            self.recorder.finish(doc.task, doc.attempt, doc.context_tokens, doc.fallbacks, doc.queue_wait_s,
                                 doc.slow_alerted, outcome)
            return
        self.recorder.context_fallback(doc.task, doc.attempt, before, smaller, outcome["error_type"], outcome["error"])
        self.work.put([Planning(doc, expected_work(doc.task, self.cfg, smaller))])

    def _finish(self, doc: DocumentRun) -> None:
        """The document's result row, folded once from its passes."""
        first = doc.levels[0]
        outcome: TaskOutcome = fold_passes(doc.tree, doc.ran, len(first.specs), first.input_tokens,
                                           self.pool.info(self.pool.workers[0]), self.cfg.summarize.trim_to_sentence)
        outcome["wall_s"] = time.time() - (doc.started_at or time.time())
        self.recorder.finish(doc.task, doc.attempt, doc.context_tokens, doc.fallbacks, doc.queue_wait_s,
                             doc.slow_alerted, outcome)

    def _feed(self, worker: Worker, errors: list[BaseException]) -> None:
        """One of a worker's feeding threads: takes work items until none is left (while its worker is down
        after a loss, it waits for the worker rather than take an item the worker cannot run, and stops
        waiting once nothing is left that it could run)."""
        while True:
            if self.pool.is_down(worker) and not self._await_restart(worker, errors, until_drained=self.work):
                return
            with self.work.taking(worker, self.stop) as item:
                if item is None:
                    return
                try:
                    item.run(self, worker)
                except Interrupted:
                    return
                except WorkerStartError as e:  # the restart this call waited for raised (the pool's own wait)
                    self._stop_on_restart_error(worker, e, errors)
                    return
                except BaseException as e:  # a bug must stop the batch loudly, not hang it
                    errors.append(e)
                    self.stop.set()
                    return

    def _stop_on_restart_error(self, worker: Worker, e: WorkerStartError, errors: list[BaseException]) -> None:
        """A restarted worker's start raised: the batch stops with that error, whichever thread saw it."""
        self.log.warning("worker_restart_failed", worker=self.pool.slot_name(worker), error=str(e))
        errors.append(e)
        self.stop.set()

    def _await_restart(self, worker: Worker, errors: list[BaseException],
                       until_drained: WorkQueue | None = None) -> bool:
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
        """Runs the open documents to an end; returns the exit code (0, 4 or 130)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run(open_tasks, already_done, total)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.log.close()

    def _run(self, open_tasks: list[Task], already_done: int, total: int) -> int:
        context = self.cfg.summarize.context_tokens
        docs = [DocumentRun(task, context) for task in open_tasks]
        self._read_passes(docs)
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
        work = self.work = WorkQueue([Planning(doc, expected_work(doc.task, self.cfg, context)) for doc in docs],
                                     workers, self.cfg.batch.sequences, self.pool.is_down)
        budgets = {doc.task.task_id: expected_decode_tokens(doc.task, self.cfg) for doc in docs}
        with self.alerts.watching(), NodeSweeper(self.offload_root, self.log), \
                BatchProgress(self.console, total, already_done, len(workers), budgets, self.alerts.busy_workers,
                              self.pool.tokens_decoded, self.log) as progress:
            self.recorder.progress = progress
            # as many calls in flight per worker as it batches sequences, so its batch stays full; the
            # queue deals each item to the least loaded worker, so a short queue is shared out evenly
            threads = [threading.Thread(target=self._feed, args=(w, errors), daemon=True)
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
