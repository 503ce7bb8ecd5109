"""The coordinator: runs a job's open tasks on a pool of Ray worker actors and checkpoints every step.

One thread per actor takes the longest open task next (long documents must not straggle at the
end). Each task runs under a tenacity policy for transient failures (I/O error, worker died,
timeout); a task whose worker died or hung goes back to the front of the shared queue, so any
worker (on any node) takes it while the lost one restarts. When a context size keeps failing, or
the worker's cache ladder is exhausted, the task is tried again with a shorter context. A result
row in results/ is the only "done" record, so a coordinator killed at any instant loses at most
the tasks in flight.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from rich.console import Console
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    wait_exponential,
)

from jobs.config import JobConfig
from jobs.faults import FaultRule
from jobs.manifest import Task
from jobs.policy import FailureClass, context_fallback_note, shorter_context
from jobs.schema import RESULT_SCHEMA, TaskState, empty_row
from runner.alerts import AlertMonitor
from runner.cluster import kill_and_wait
from runner.joblog import JobLog
from runner.metrics import BatchMetrics
from runner.node_sweeper import NodeSweeper
from runner.progress import BatchProgress
from runner.worker import SummaryWorker
from storage.checkpoint import CheckpointLog
from storage.lease import LeaseLostError
from storage.jobdir import JobDir
from storage.lock import HeldLock
from storage.location import no_fence

EXIT_OK = 0
EXIT_FAILED_TASKS = 3
EXIT_NO_WORKERS = 4
EXIT_LEASE_LOST = 5
EXIT_INTERRUPTED = 130
#: How long a restarted worker may take to come back (process start + model load), not task time.
WORKER_RESTART_TIMEOUT_S = 300.0


class TransientFailure(Exception):
    """A failure worth retrying with the same settings."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class WorkerLost(TransientFailure):
    """The worker died or hung: the task can run on any other worker while this one restarts."""


class Interrupted(Exception):
    """The user asked the batch to stop; the task is left for `resume`."""


@dataclass
class _TaskRun:
    task: Task
    attempt: int = 0
    context_tokens: int = 0
    tries_at_context: int = 0  # attempts at the current context size, on whichever workers
    fallbacks: list[str] = field(default_factory=list)
    queue_wait_s: float | None = None
    slow_alerted: bool = False


class _WorkQueue:
    """Open tasks, longest first, shared by the workers' threads; a task handed back by a lost
    worker goes in front. `take` waits while other threads still hold tasks they may hand back."""

    def __init__(self, runs: list[_TaskRun]) -> None:
        self._order = itertools.count()
        self._heap = [(1, -run.task.n_chars, next(self._order), run) for run in runs]
        heapq.heapify(self._heap)
        self._held = 0
        self._changed = threading.Condition()

    def take(self, stop: threading.Event) -> _TaskRun | None:
        """The next task, or None once none is left and none can come back (or the batch stops)."""
        with self._changed:
            while not stop.is_set():
                if self._heap:
                    self._held += 1
                    return heapq.heappop(self._heap)[-1]
                if self._held == 0:
                    return None
                self._changed.wait(0.2)
            return None

    def finished(self) -> None:
        with self._changed:
            self._held -= 1
            self._changed.notify_all()

    def hand_back(self, run: _TaskRun) -> None:
        with self._changed:
            heapq.heappush(self._heap, (0, -run.task.n_chars, next(self._order), run))
            self._held -= 1
            self._changed.notify_all()

    def drained(self) -> bool:
        """Nothing left to run and nothing in flight that could come back."""
        with self._changed:
            return not self._heap and self._held == 0

    def left(self) -> int:
        with self._changed:
            return len(self._heap)


def _attempts_at_context_reach(limit: int, run: _TaskRun) -> Any:
    """A tenacity stop that counts a task's attempts at its context size across workers."""
    return lambda state: run.tries_at_context >= limit


class Coordinator:
    def __init__(self, job: JobDir, job_id: str, config: JobConfig, offload_root: Path,
                 faults: list[FaultRule], console: Console, lock: HeldLock | None = None) -> None:
        """`lock` is the job lock held for this run: every write into the job folder is fenced with
        it, and the batch stops once it is lost (a lease another coordinator took over)."""
        self.job = job
        self.lock = lock
        fence = lock.check if lock is not None else no_fence
        self.job_id = job_id
        self.cfg = config
        self.offload_root = offload_root
        self.faults = faults
        self.console = console
        self.stop = threading.Event()
        self.log = JobLog(job.log, fence)
        self.checkpoint = CheckpointLog(
            job.path, flush_every=config.checkpoint.flush_every,
            flush_interval_s=config.checkpoint.flush_interval_s, fence=fence,
        )
        self._record_lock = threading.RLock()
        self._closed = False
        self.alerts = AlertMonitor(self.log, console)
        self.metrics = BatchMetrics(job_id)
        self.worker_slots: dict[Any, str] = {}
        self._queued_at = time.time()

    # -- events and results ---------------------------------------------------------------
    def _event(self, run: _TaskRun, state: TaskState, worker: str = "", error_type: str | None = None,
               error: str | None = None, cache_strategy: str | None = None) -> None:
        with self._record_lock:
            if self._closed:
                return
            self.checkpoint.add_event({
                "task_id": run.task.task_id, "attempt": run.attempt, "state": state.value,
                "ts": time.time(), "worker": worker, "error_type": error_type, "error": error,
                "context_tokens": run.context_tokens, "cache_strategy": cache_strategy,
            })

    def _finish(self, run: _TaskRun, outcome: dict[str, Any], progress: BatchProgress) -> None:
        row = empty_row(RESULT_SCHEMA)
        row.update({k: v for k, v in outcome.items() if k in row})
        row.update(
            doc_id=run.task.doc_id, task_id=run.task.task_id, attempts=run.attempt,
            context_tokens=run.context_tokens, fallbacks=run.fallbacks + outcome.get("fallbacks", []),
            meta=json.dumps(run.task.meta), finished_at=time.time(), queue_wait_s=run.queue_wait_s,
        )
        with self._record_lock:
            if self._closed or (self.stop.is_set() and row["status"] != "done"):
                return
            self.checkpoint.add_result(row)
            self._event(run, TaskState(row["status"]), row.get("worker") or "",
                        row.get("error_type"), row.get("error"), row.get("cache_strategy"))
        level = self.log.info if row["status"] == "done" else self.log.warning
        level("task_" + row["status"], task_id=run.task.task_id, doc_id=run.task.doc_id,
              attempts=run.attempt, context_tokens=run.context_tokens, fallbacks=row["fallbacks"],
              cache_strategy=row.get("cache_strategy"), error_type=row.get("error_type"),
              error=row.get("error"))
        self.alerts.task_finished(run.task.task_id, run.task.doc_id, run.task.n_chars, outcome, row["fallbacks"],
                                  run.slow_alerted)
        self.metrics.task_finished(row)
        progress.record(row["status"], row.get("output_tokens") or 0, len(row["fallbacks"]))

    # -- one task ---------------------------------------------------------------------------
    def _call(self, actor: Any, run: _TaskRun) -> dict[str, Any]:
        if self.stop.is_set():
            raise Interrupted()
        run.attempt += 1
        run.tries_at_context += 1
        if run.queue_wait_s is None:
            run.queue_wait_s = time.time() - self._queued_at
        self._event(run, TaskState.RUNNING)
        slot = self.worker_slots.get(actor, "worker")
        self.alerts.task_started(run.task.task_id, run.task.doc_id, run.task.n_chars, slot)
        self.metrics.set_running(self.alerts.active())
        ref = actor.run.remote(dataclasses.asdict(run.task), run.attempt, run.context_tokens)
        try:
            outcome = ray.get(ref, timeout=self.cfg.retry.task_timeout_s)
        except GetTimeoutError:
            ray.kill(actor, no_restart=False)  # a hung worker is restarted, with a fresh model
            self._worker_restarted(slot, "TimeoutError", run.task.doc_id)
            raise WorkerLost(
                "TimeoutError", f"no result within retry.task_timeout_s={self.cfg.retry.task_timeout_s}s"
            ) from None
        except RayActorError as e:
            if self.stop.is_set():
                raise Interrupted() from None
            self._worker_restarted(slot, "WorkerDied", run.task.doc_id)
            raise WorkerLost("WorkerDied", f"worker process died: {e}") from None
        finally:
            run.slow_alerted = self.alerts.task_stopped(run.task.task_id)
            self.metrics.set_running(self.alerts.active())
        if outcome.get("failure_class") == FailureClass.TRANSIENT:
            raise TransientFailure(outcome["error_type"], outcome["error"])
        return outcome

    def _worker_restarted(self, slot: str, reason: str, doc_id: str) -> None:
        self.alerts.worker_restarted(slot, reason, doc_id)
        self.metrics.worker_restarted()

    def _note_retry(self, run: _TaskRun, err: BaseException | None, sleep_s: float) -> None:
        error_type = getattr(err, "error_type", type(err).__name__)
        self._event(run, TaskState.RETRYING, error_type=error_type, error=str(err))
        self.log.warning("task_retry", task_id=run.task.task_id, doc_id=run.task.doc_id,
                         attempt=run.attempt, error_type=error_type, error=str(err), sleep_s=round(sleep_s, 3))

    def _before_retry(self, run: _TaskRun) -> Any:
        def hook(state: RetryCallState) -> None:
            self._note_retry(run, state.outcome.exception() if state.outcome else None, state.upcoming_sleep)
        return hook

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Interrupted()

    def _run_task(self, actor: Any, run: _TaskRun, progress: BatchProgress) -> tuple[bool, bool]:
        """Runs `run` until it ends (finished: True) or its worker is lost and another worker must
        take it on (False); the second value says whether this worker was lost."""
        task = run.task
        retry = self.cfg.retry
        while True:
            lost = False
            retrying = Retrying(
                stop=_attempts_at_context_reach(retry.max_attempts, run),
                wait=wait_exponential(multiplier=retry.backoff_initial_s, min=retry.backoff_initial_s,
                                      max=retry.backoff_max_s),
                retry=retry_if_exception_type(TransientFailure) & retry_if_not_exception_type(WorkerLost),
                before_sleep=self._before_retry(run),
                sleep=self._sleep,
                reraise=True,
            )
            try:
                outcome = retrying(self._call, actor, run)
            except TransientFailure as e:
                lost = isinstance(e, WorkerLost)
                if lost and run.tries_at_context < retry.max_attempts:
                    self._note_retry(run, e, 0.0)
                    return False, lost
                outcome = {"status": "failed", "failure_class": FailureClass.TRANSIENT.value,
                           "error_type": e.error_type, "error": str(e)}
            if outcome["status"] == "done" or outcome["failure_class"] == FailureClass.INPUT:
                self._finish(run, outcome, progress)
                return True, lost
            run.fallbacks.extend(outcome.get("fallbacks", []))
            outcome["fallbacks"] = []
            smaller = shorter_context(run.context_tokens, retry.context_shrink,
                                      self.cfg.summarize.min_context_tokens)
            if smaller is None:
                self._finish(run, outcome, progress)
                return True, lost
            run.fallbacks.append(context_fallback_note(run.context_tokens, smaller, outcome["error_type"]))
            self.log.warning("context_fallback", task_id=task.task_id, doc_id=task.doc_id,
                             from_tokens=run.context_tokens, to_tokens=smaller,
                             error_type=outcome["error_type"], error=outcome["error"])
            self._event(run, TaskState.RETRYING, error_type=outcome["error_type"], error=outcome["error"])
            run.context_tokens = smaller
            run.tries_at_context = 0
            if lost:  # the shorter context goes to whichever worker is free
                return False, lost

    def _drive(self, actor: Any, work: _WorkQueue, progress: BatchProgress,
               errors: list[BaseException]) -> None:
        while (run := work.take(self.stop)) is not None:
            try:
                finished, lost = self._run_task(actor, run, progress)
            except Interrupted:
                work.finished()
                return
            except BaseException as e:  # a bug must stop the batch loudly, not hang it
                work.finished()
                errors.append(e)
                self.stop.set()
                return
            if not finished:
                work.hand_back(run)  # another worker takes it now; this one waits for its restart
                if not self._await_restart(actor, until_drained=work):
                    return
                continue
            # a task that ended on a lost worker still holds the batch open until the worker is back:
            # its restart sweeps the dead process's scratch dir
            restarted = self._await_restart(actor) if lost else True
            work.finished()
            if not restarted:
                return

    # -- the batch ----------------------------------------------------------------------------
    def _start_workers(self, count: int) -> list[Any]:
        resources = ray.cluster_resources()
        gpus = self.cfg.workers.gpus_per_worker if resources.get("GPU", 0) > 0 else 0
        # SPREAD: one worker per node before any node gets a second, so a lost node costs the fewest
        remote_cls = ray.remote(SummaryWorker).options(
            num_cpus=self.cfg.workers.cpus_per_worker, num_gpus=gpus,
            max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD",
        )
        threads = max(1, int(self.cfg.workers.cpus_per_worker))
        config = self.cfg.model_dump(mode="json")
        faults = [f.model_dump() for f in self.faults]
        actors = [remote_cls.remote(config, self.job_id, str(self.offload_root), faults, threads)
                  for _ in range(count)]
        self.worker_slots = {actor: f"worker slot {i}" for i, actor in enumerate(actors)}
        infos = ray.get([a.info.remote() for a in actors])
        for info in infos:
            self.log.info("worker_ready", **info)
        return actors

    def _await_restart(self, actor: Any, until_drained: _WorkQueue | None = None) -> bool:
        """Wait until Ray has restarted a killed or crashed worker (its start sweeps the scratch dir the
        dead process left; its next task must reach it, not the dying incarnation). False when it did
        not come back in time (no capacity left for it), or the batch needs it no more."""
        deadline = time.monotonic() + WORKER_RESTART_TIMEOUT_S
        ready = actor.info.remote()
        while not self.stop.is_set() and not (until_drained is not None and until_drained.drained()):
            if time.monotonic() >= deadline:
                self.log.warning("worker_restart_unfinished", worker=self.worker_slots.get(actor),
                                 hint="no capacity left for it; a killed worker's scratch dir is swept "
                                 "when its node comes back, or by `kvbatch clean` there")
                return False
            try:
                ray.get(ready, timeout=1.0)
                return True
            except RayActorError:  # it reached the dying incarnation: ask the next one
                time.sleep(0.1)
                ready = actor.info.remote()
            except GetTimeoutError:
                pass
        return False

    def worker_count(self, open_tasks: int) -> int:
        if self.cfg.workers.count != "auto":
            wanted = self.cfg.workers.count
        else:
            resources = ray.cluster_resources()
            if resources.get("GPU", 0) > 0 and self.cfg.workers.gpus_per_worker > 0:
                wanted = int(resources["GPU"] // self.cfg.workers.gpus_per_worker)
            else:
                wanted = int(resources.get("CPU", 1) // self.cfg.workers.cpus_per_worker)
        return max(1, min(wanted, open_tasks))

    def run(self, open_tasks: list[Task], already_done: int, total: int) -> int:
        """Runs the open tasks to an end; returns the exit code (0, 3 or 130)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run(open_tasks, already_done, total)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.log.close()

    def _run(self, open_tasks: list[Task], already_done: int, total: int) -> int:
        context = self.cfg.summarize.context_tokens
        work = _WorkQueue([_TaskRun(task=task, context_tokens=context) for task in open_tasks])
        count = self.worker_count(len(open_tasks))
        self.log.info("batch_start", open_tasks=len(open_tasks), workers=count)
        actors = self._start_workers(count) if open_tasks else []
        self._queued_at = time.time()  # queue wait counts from here: waiting for a free worker
        errors: list[BaseException] = []
        with self.alerts.watching(), NodeSweeper(self.offload_root, self.log), \
                BatchProgress(self.console, total, already_done, len(actors), self.alerts.active) as progress:
            threads = [threading.Thread(target=self._drive, args=(a, work, progress, errors), daemon=True)
                       for a in actors]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads) and not self.stop.is_set():
                for t in threads:
                    t.join(timeout=0.2)
                if self.lock is not None and self.lock.lost:
                    self.stop.set()
            if self.stop.is_set():
                self._abandon_in_flight(actors, threads)
        with self._record_lock:
            self._closed = True
            try:
                self.checkpoint.close()
            except LeaseLostError as e:
                errors.append(e)
        lease_lost = next((e for e in errors if isinstance(e, LeaseLostError)), None)
        if lease_lost is None and self.lock is not None and self.lock.lost:
            try:
                self.lock.check()
            except LeaseLostError as e:
                lease_lost = e
        if lease_lost is not None:
            self.log.warning("lease_lost", error=str(lease_lost))
            self.console.print(f"[red]{lease_lost}")
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

    def _abandon_in_flight(self, actors: list[Any], threads: list[threading.Thread]) -> None:
        """Killing the actors ends every pending ray.get at once, so no thread outlives the batch; the
        batch's last sweep runs once their processes are gone, so it removes their task dirs."""
        still_alive = kill_and_wait(actors)
        if still_alive:
            self.log.warning("workers_not_gone", processes=still_alive,
                             hint="their scratch dirs stay until `kvbatch clean` runs after they exit")
        for t in threads:
            t.join(timeout=30)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop.is_set():
            self.console.print("[red]second interrupt: exiting now (the job is still resumable)")
            os._exit(EXIT_INTERRUPTED)
        self.stop.set()
        self.console.print(
            f"[yellow]{signal.Signals(signum).name}: stopping; tasks in flight are abandoned and will "
            "rerun on resume (interrupt again to exit at once)"
        )
