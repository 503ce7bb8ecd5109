"""The dealer: runs the work items of the documents in a batch, one call at a time, and keeps what comes back.

A document (jobs/document_run.py) is planned by a worker and its passes dealt to any worker, each pass's
row kept (storage/passes.py) before anything that depends on it is dealt (docs/design.md, "Documents and
passes"). A call whose worker died or hung goes back to the queue, for any worker; the rest of the
failures follow docs/design.md, "Failures", under one tenacity policy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import Retrying, retry_if_exception_type, retry_if_not_exception_type, wait_exponential

from jobs.balance import WorkQueue, expected_work, pass_work
from jobs.config import JobConfig, RetryConfig
from jobs.document_run import DocumentRun, Stage
from jobs.outcome import CallOutcome, TaskOutcome, fold_passes
from jobs.passes import PassSpec
from jobs.policy import FINAL_CLASSES, FailureClass, context_fallback_note, shorter_context
from runner.observe.joblog import JobLog
from runner.pool import PoolStopped, TransientFailure, Worker, WorkerLost, WorkerPool
from runner.recorder import TaskRecorder
from storage.checkpoint import CheckpointLog

#: A task whose worker was lost this often while other tasks shared it runs alone from then on, and
#: only then do losses count as its own attempts: a poison document must not use up its batch-mates'.
BATCH_LOSSES_BEFORE_ALONE = 2


class Interrupted(Exception):
    """The user asked the batch to stop; the task is left for `resume`."""


class Unwanted(Exception):
    """The call's work is no longer wanted: its document moved to a shorter context or ended."""


@dataclass(eq=False)
class Planning:
    """A work item: a document whose next level needs a plan (its first, or one handed back by a lost worker)."""

    doc: DocumentRun
    work: float

    def run(self, dealer: Dealer, worker: Worker) -> None:
        dealer.plan(worker, self.doc)


@dataclass(eq=False)
class Pass:
    """A work item: one pass of a document."""

    doc: DocumentRun
    spec: PassSpec
    work: float

    def run(self, dealer: Dealer, worker: Worker) -> None:
        dealer.run_pass(worker, self)


def task_retrying(retry: RetryConfig, before_sleep: Any, sleep: Any) -> Retrying:
    """The transient-failure policy, built once: exponential backoff, a lost worker never waited for
    here (its task goes back to the queue), `retry.max_attempts` attempts per context size: a document's
    calls counted on any worker (a call handed to another keeps its count; a shorter context starts anew)."""
    return Retrying(
        stop=lambda state: state.args[0].tries_at_context >= retry.max_attempts,
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


class Dealer:
    """Runs the work items of a batch's documents, one call at a time, and keeps what comes back."""

    def __init__(self, config: JobConfig, pool: WorkerPool, docs: list[DocumentRun], recorder: TaskRecorder,
                 checkpoint: CheckpointLog, log: JobLog, stop: threading.Event) -> None:
        """`docs`: the batch's open documents, each planned first, from one queue for the pool's workers."""
        self.cfg = config
        self.pool = pool
        self.work = WorkQueue([self._planning(doc) for doc in docs], pool.workers, config.batch.sequences,
                              pool.is_down)
        self.recorder = recorder
        self.checkpoint = checkpoint
        self.log = log
        self.stop = stop
        self.retrying = task_retrying(config.retry, lambda state: self._note_retry(
            state.args[0], state.outcome.exception() if state.outcome else None, state.upcoming_sleep), self._sleep)
        self._queued_at = time.time()  # queue wait counts from here: waiting for a free worker
        self._lock = threading.RLock()  # the documents' states: several feeding threads run one's passes

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
                              expected_work=round(self._planning(doc).work), worker_work=round(self.work.load(worker)))
                call = lambda: self.pool.plan(worker, doc.task, context, doc.alone)  # noqa: E731
            else:
                call = lambda: self.pool.plan_merge(worker, doc.task, level, parts, context, doc.alone)  # noqa: E731
            outcome = self._call(worker, doc, call, lambda: doc.context_tokens == context,
                                 lambda: self._plan_elsewhere(doc))
            if outcome is None:  # handed back, or no longer wanted
                return
            if outcome["status"] != "done":
                self._failed(doc, outcome, context)  # nothing if it moved on meanwhile
                return
            with self._lock:
                if (doc.stage, doc.level, doc.context_tokens) != (Stage.PLANNING, level, context):
                    return  # it ended or fell back to a shorter context meanwhile
                doc.planned(outcome["plan"])
                passes = [Pass(doc, spec, pass_work(doc.task, self.cfg, len(spec.prompt)))
                          for spec in doc.next_passes()]
                done = doc.stage is Stage.DONE and doc.claim()
            self.log.info("level_planned", task_id=doc.task.task_id, doc_id=doc.task.doc_id, level=level,
                          context_tokens=context, passes=len(outcome["plan"].specs), to_run=len(passes),
                          final=any(spec.final for spec in outcome["plan"].specs), worker=self.pool.slot_name(worker))
            self.work.put(passes)
            if done:
                self._finish(doc)
                return

    def _plan_elsewhere(self, doc: DocumentRun) -> None:
        """The planning goes back in front, for any worker (this one was lost)."""
        with self._lock:
            doc.unclaim()
        self.work.put([self._planning(doc)])

    def _planning(self, doc: DocumentRun) -> Planning:
        """The work item that plans `doc`'s next level, with the document's expected work at its context."""
        return Planning(doc, expected_work(doc.task, self.cfg, doc.context_tokens))

    def run_pass(self, worker: Worker, item: Pass) -> None:
        """Runs one pass; its row is kept before anything that depends on it is dealt."""
        doc, spec = item.doc, item.spec
        with self._lock:
            if not doc.wants(spec):
                return
        self.log.info("pass_assigned", task_id=spec.task_id, doc_id=spec.doc_id, level=spec.level, index=spec.index,
                      context_tokens=spec.context_tokens, worker=self.pool.slot_name(worker))
        outcome = self._call(worker, doc, lambda: self.pool.run_pass(worker, spec, doc.attempt, doc.alone),
                             lambda: doc.wants(spec), lambda: self.work.put([item]))
        if outcome is None:
            return
        if outcome["status"] != "done":
            with self._lock:
                doc.pass_ended(spec)
            self._failed(doc, outcome, spec.context_tokens)
            return
        row = outcome["row"]
        with self._lock:
            wanted = doc.wants(spec)
        if not wanted:  # of a context given up, or the document ended: nothing will depend on it
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
              hand_back: Callable[[], None]) -> CallOutcome | None:
        """The call's outcome after transient failures were retried (a failed one when they used up the
        document's attempts); None when it was handed back to the queue (`hand_back`: for any worker) or
        its work is no longer wanted."""
        try:
            return self.retrying.copy()(self._attempt, doc, worker, call, wanted)
        except Unwanted:
            return None
        except WorkerLost as e:
            if doc.tries_at_context < self.cfg.retry.max_attempts:
                self._note_retry(doc, e, 0.0)
                hand_back()
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
            with self._lock:
                failed = doc.first_loss(lost.event)  # a loss that ended several of its calls counts once
            if failed:
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

    def _note_retry(self, doc: DocumentRun, err: BaseException | None, sleep_s: float) -> None:
        error_type = getattr(err, "error_type", type(err).__name__)
        self.recorder.retry(doc.task, doc.attempt, doc.context_tokens, error_type, str(err), sleep_s)

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Interrupted()

    # -- a document's end -------------------------------------------------------------------------
    def _failed(self, doc: DocumentRun, outcome: CallOutcome, context: int) -> None:
        """A call at `context` failed for good: the document starts over at a shorter one (a new Planning
        item), or ends failed when it cannot (final class, shortest context); nothing when it ended or
        moved to a shorter context meanwhile (another of its calls failed first)."""
        with self._lock:
            if doc.ended or doc.context_tokens != context:
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
        self.work.put([self._planning(doc)])

    def _finish(self, doc: DocumentRun) -> None:
        """The document's result row, folded once from its passes."""
        first = doc.levels[0]
        outcome: TaskOutcome = fold_passes(doc.tree, doc.ran, len(first.specs), first.input_tokens,
                                           self.pool.info(self.pool.workers[0]), self.cfg.summarize.trim_to_sentence)
        outcome["wall_s"] = time.time() - (doc.started_at or time.time())
        self.recorder.finish(doc.task, doc.attempt, doc.context_tokens, doc.fallbacks, doc.queue_wait_s,
                             doc.slow_alerted, outcome)

