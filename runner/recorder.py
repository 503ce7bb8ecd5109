"""The task recorder: every state a task passes through goes to the checkpoint, job.log, the alerts, the
metrics and the progress bar, from one place. While the batch stops only finished summaries are recorded,
so an interrupted task is left for `resume`, not recorded as failed."""

from __future__ import annotations

import json
import threading
import time

from jobs.outcome import TaskOutcome
from jobs.schema import RESULT_SCHEMA, TaskState, empty_row
from jobs.task import Task
from runner.observe.alerts import AlertMonitor
from runner.observe.joblog import JobLog
from runner.observe.metrics import BatchMetrics
from runner.observe.progress import BatchProgress
from storage.checkpoint import CheckpointLog


class TaskRecorder:
    def __init__(self, checkpoint: CheckpointLog, log: JobLog, alerts: AlertMonitor, metrics: BatchMetrics,
                 stopping: threading.Event) -> None:
        self.checkpoint = checkpoint
        self.log = log
        self.alerts = alerts
        self.metrics = metrics
        self.progress: BatchProgress | None = None
        self._stopping = stopping
        self._lock = threading.RLock()
        self._closed = False

    def event(self, task: Task, attempt: int, context_tokens: int, state: TaskState, worker: str = "",
              error_type: str | None = None, error: str | None = None, cache_strategy: str | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self.checkpoint.add_event({
                "task_id": task.task_id, "attempt": attempt, "state": state.value, "ts": time.time(),
                "worker": worker, "error_type": error_type, "error": error, "context_tokens": context_tokens,
                "cache_strategy": cache_strategy,
            })

    def started(self, task: Task, attempt: int, context_tokens: int, slot: str) -> None:
        self.event(task, attempt, context_tokens, TaskState.RUNNING)
        self.alerts.task_started(task.task_id, task.doc_id, task.n_chars, slot)
        self.metrics.set_running(self.alerts.active())

    def stopped(self, task: Task) -> bool:
        """The attempt is over; True when it was flagged slow meanwhile."""
        slow = self.alerts.task_stopped(task.task_id)
        self.metrics.set_running(self.alerts.active())
        return slow

    def retry(self, task: Task, attempt: int, context_tokens: int, error_type: str, error: str,
              sleep_s: float) -> None:
        self.event(task, attempt, context_tokens, TaskState.RETRYING, error_type=error_type, error=error)
        self.log.warning("task_retry", task_id=task.task_id, doc_id=task.doc_id, attempt=attempt,
                         error_type=error_type, error=error, sleep_s=round(sleep_s, 3))

    def context_fallback(self, task: Task, attempt: int, from_tokens: int, to_tokens: int, error_type: str,
                         error: str) -> None:
        self.log.warning("context_fallback", task_id=task.task_id, doc_id=task.doc_id, from_tokens=from_tokens,
                         to_tokens=to_tokens, error_type=error_type, error=error)
        self.event(task, attempt, from_tokens, TaskState.RETRYING, error_type=error_type, error=error)

    def worker_lost(self, slot: str, reason: str, doc_id: str | None) -> None:
        self.alerts.worker_restarted(slot, reason, doc_id)
        self.metrics.worker_restarted()

    def finish(self, task: Task, attempt: int, context_tokens: int, fallbacks: list[str],
               queue_wait_s: float | None, slow_alerted: bool, outcome: TaskOutcome) -> None:
        """The task's result row: the one record that says it ended."""
        row = empty_row(RESULT_SCHEMA)
        row.update({k: v for k, v in outcome.items() if k in row})
        row.update(
            doc_id=task.doc_id, task_id=task.task_id, attempts=attempt, context_tokens=context_tokens,
            fallbacks=fallbacks + outcome.get("fallbacks", []), meta=json.dumps(task.meta),
            finished_at=time.time(), queue_wait_s=queue_wait_s,
            source_format=task.source_format, encoding=task.encoding, n_chars=task.n_chars,
        )
        with self._lock:
            if self._closed or (self._stopping.is_set() and row["status"] != "done"):
                return
            self.checkpoint.add_result(row)
            self.event(task, attempt, context_tokens, TaskState(row["status"]), row.get("worker") or "",
                       row.get("error_type"), row.get("error"), row.get("cache_strategy"))
        level = self.log.info if row["status"] == "done" else self.log.warning
        level("task_" + row["status"], task_id=task.task_id, doc_id=task.doc_id, attempts=attempt,
              context_tokens=context_tokens, fallbacks=row["fallbacks"], cache_strategy=row.get("cache_strategy"),
              error_type=row.get("error_type"), error=row.get("error"),
              decode_row_steps=outcome.get("decode_row_steps"))  # static, and eager by why (kvbatch status sums them)
        self.alerts.task_finished(task.task_id, task.doc_id, task.n_chars, outcome, row["fallbacks"], slow_alerted)
        self.metrics.task_finished(row)
        if self.progress is not None:
            self.progress.record(task.task_id, row["status"], row.get("output_tokens") or 0, len(row["fallbacks"]))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.checkpoint.close()
