"""The coordinator: runs a job's open documents on the worker pool, from the workers' start to the exit code.

Each worker has `batch.max_sequences` feeding threads, which take work items from one `WorkQueue`
(jobs/balance.py) and run them (runner/dealer.py). The coordinator holds the job's lock and is the job
folder's only writer (docs/cluster.md); it stops the batch on a signal or a lost lease.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from jobs.balance import WorkQueue, expected_decode_tokens
from jobs.config import JobConfig
from jobs.document_run import DocumentRun
from jobs.faults import FaultRule
from jobs.task import Task
from runner.cluster import NodeSweeper
from runner.dealer import Dealer, Interrupted
from runner.observe.alerts import AlertMonitor
from runner.observe.joblog import JobLog
from runner.observe.metrics import BatchMetrics
from runner.observe.progress import BatchProgress
from runner.pool import (
    WORKER_RESTART_TIMEOUT_S,
    PoolStopped,
    Worker,
    WorkerPool,
    WorkersNotStarted,
    WorkerStartError,
)
from runner.recorder import TaskRecorder
from storage.checkpoint import CheckpointLog
from storage.jobdir import JobDir
from storage.lease import LeaseLostError
from storage.lock import HeldLock
from storage.passes import read_passes, remove_passes, tasks_with_passes

EXIT_OK = 0
EXIT_FAILED_TASKS = 3
EXIT_NO_WORKERS = 4
EXIT_LEASE_LOST = 5
EXIT_INTERRUPTED = 130


class Coordinator:
    def __init__(self, job: JobDir, job_id: str, config: JobConfig, offload_root: Path,
                 faults: list[FaultRule], console: Console, lock: HeldLock) -> None:
        """`lock` is the job lock held for this run: every write into the job folder is fenced with
        it, and the batch stops once it is lost (a lease another coordinator took over)."""
        self.cfg = config
        self.offload_root = offload_root
        self.console = console
        self.lock = lock
        self.stop = threading.Event()
        self.log = JobLog(job.log, lock.check)
        self.alerts = AlertMonitor(self.log, console)
        self.job = job
        checkpoint = self.checkpoint = CheckpointLog(job.path, flush_every=config.checkpoint.flush_every,
                                   flush_interval_s=config.checkpoint.flush_interval_s, fence=lock.check,
                                   after_results=self._drop_passes)
        self.recorder = TaskRecorder(checkpoint, self.log, self.alerts, BatchMetrics(job_id), self.stop)
        self.pool = WorkerPool(config, job_id, offload_root, faults, self.log)

    def _drop_passes(self, task_ids: list[str]) -> None:
        """A document's passes go once its result is published; if this fails the next run's sweep takes them."""
        try:
            remove_passes(self.job.path, task_ids, self.lock.check)
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

    def _feed(self, worker: Worker, dealer: Dealer, errors: list[BaseException]) -> None:
        """One of a worker's feeding threads: takes work items until none is left (while its worker is down
        it waits for the worker rather than take an item the worker cannot run)."""
        while True:
            if self.pool.is_down(worker) and not self._await_restart(worker, errors, dealer.work):
                return
            with dealer.work.taking(worker, self.stop) as item:
                if item is None:
                    return
                try:
                    item.run(dealer, worker)
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

    def _await_restart(self, worker: Worker, errors: list[BaseException], work: WorkQueue) -> bool:
        """Whether the worker is back (not waited for once `work` is drained); a restart whose start raised
        stops the batch with that error."""
        def give_up() -> bool:
            return self.stop.is_set() or work.drained()

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
        errors: list[BaseException] = []
        workers = self.pool.workers
        dealer = Dealer(self.cfg, self.pool, docs, self.recorder, self.checkpoint, self.log, self.stop)
        budgets = {doc.task.task_id: expected_decode_tokens(doc.task, self.cfg) for doc in docs}
        with self.alerts.watching(), NodeSweeper(self.offload_root, self.log), \
                BatchProgress(self.console, total, already_done, len(workers), budgets, self.alerts.busy_workers,
                              self.pool.tokens_decoded, self.log) as progress:
            self.recorder.progress = progress
            # as many calls in flight per worker as it batches sequences, so its batch stays full; the
            # queue deals each item to the least loaded worker, so a short queue is shared out evenly
            threads = [threading.Thread(target=self._feed, args=(w, dealer, errors), daemon=True)
                       for _ in range(self.cfg.batch.sequences) for w in workers]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads) and not self.stop.is_set():
                for t in threads:
                    t.join(timeout=0.2)
                if self.lock.lost:
                    self.stop.set()
            if self.stop.is_set():  # killing the workers ends every pending call at once: no thread outlives the batch
                self._name_survivors(self.pool.kill_all())
                for t in threads:
                    t.join(timeout=30)
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
        if left := dealer.work.left():
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

    def _lease_lost(self, errors: list[BaseException]) -> LeaseLostError | None:
        lost = next((e for e in errors if isinstance(e, LeaseLostError)), None)
        if lost is None and self.lock.lost:
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
