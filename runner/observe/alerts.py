"""Alerts an operator of a long batch must act on, as warnings in job.log and on the console
(docs/status.md "Alerts").

`AlertRules` is the decision logic; `AlertMonitor` feeds it, runs a watchdog thread for the clocked rules.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
from rich.console import Console
from rich.markup import escape

from jobs.outcome import TaskOutcome
from runner.observe.joblog import JobLog
from runner.observe.progress import env_number

MEMORY_FRACTION_ENV = "KVBATCH_ALERT_MEMORY_FRACTION"
SLOW_FACTOR = 2.0
MEMORY_FRACTION = 0.8
MEMORY_REARM_MARGIN = 0.05
MIN_CLASS_SAMPLES = 3
RESTARTS_ALERT = 2
WATCH_INTERVAL_S = 1.0


def length_class(n_chars: int) -> str:
    """Power-of-two buckets of document length: tasks in one bucket should take similar times."""
    low = 1 << (max(n_chars, 1).bit_length() - 1)
    return f"{low}-{2 * low - 1} chars"


def memory_threshold() -> float:
    """The used fraction of memory above which `memory` alerts fire: $KVBATCH_ALERT_MEMORY_FRACTION, else 0.8."""
    return env_number(MEMORY_FRACTION_ENV, MEMORY_FRACTION, "a fraction such as 0.8", lambda v: 0 < v <= 1,
                      "a fraction in (0, 1]")


@dataclass(frozen=True)
class Alert:
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Running:
    doc_id: str
    n_chars: int
    started: float
    worker: str
    alerted: bool = False


class AlertRules:
    """Decides which alerts fire; fed with observations, holds no clock and writes nothing."""

    def __init__(self, memory_fraction: float = MEMORY_FRACTION) -> None:
        self.memory_fraction = memory_fraction
        self.running: dict[str, _Running] = {}
        self._times: dict[str, list[float]] = defaultdict(list)
        self._restarts: dict[object, int] = defaultdict(int)
        self._memory_high: set[tuple[str, str]] = set()

    def _median(self, n_chars: int) -> float | None:
        times = self._times[length_class(n_chars)]
        return statistics.median(times) if len(times) >= MIN_CLASS_SAMPLES else None

    def _slow(self, task_id: str, run: _Running, seconds: float, state: str) -> Alert:
        median = self._median(run.n_chars)
        run.alerted = True
        return Alert("slow_task", (
            f"task {task_id} ({run.doc_id}) {state} {seconds:.1f} s, over {SLOW_FACTOR:g} x the "
            f"median {median:.1f} s of {length_class(run.n_chars)} documents"
        ), {"task_id": task_id, "doc_id": run.doc_id, "seconds": round(seconds, 3),
            "median_s": round(median, 3), "length_class": length_class(run.n_chars), "worker": run.worker})

    def task_started(self, task_id: str, doc_id: str, n_chars: int, now: float, worker: str) -> None:
        self.running[task_id] = _Running(doc_id, n_chars, now, worker)

    def task_stopped(self, task_id: str) -> _Running | None:
        return self.running.pop(task_id, None)

    def overdue(self, now: float) -> list[Alert]:
        """Running tasks past the slow threshold, each reported once per attempt."""
        alerts = []
        for task_id, run in self.running.items():
            median = self._median(run.n_chars)
            if not run.alerted and median is not None and now - run.started > SLOW_FACTOR * median:
                alerts.append(self._slow(task_id, run, now - run.started, "running for"))
        return alerts

    def task_finished(self, task_id: str, doc_id: str, n_chars: int, wall_s: float | None,
                      fallbacks: list[str], slow_alerted: bool = False) -> list[Alert]:
        alerts = []
        if wall_s is not None:
            median = self._median(n_chars)
            if not slow_alerted and median is not None and wall_s > SLOW_FACTOR * median:
                alerts.append(self._slow(task_id, _Running(doc_id, n_chars, 0.0, ""), wall_s, "took"))
            self._times[length_class(n_chars)].append(wall_s)
        if len(fallbacks) > 1:
            alerts.append(Alert("repeated_fallbacks", (
                f"task {task_id} ({doc_id}) fell back {len(fallbacks)} times: {', '.join(fallbacks)}"
            ), {"task_id": task_id, "doc_id": doc_id, "fallbacks": fallbacks}))
        return alerts

    def worker_restarted(self, worker: str, reason: str, doc_id: str | None = None) -> list[Alert]:
        """Counted per worker slot and per document (`doc_id`, the task the worker was running)."""
        counters = [(worker, f"{worker} restarted")]
        if doc_id is not None:
            counters.append((("doc", doc_id), f"document {doc_id!r} took down a worker"))
        alerts = []
        for key, what in counters:
            self._restarts[key] += 1
            count = self._restarts[key]
            if count >= RESTARTS_ALERT:
                alerts.append(Alert("worker_restarts", f"{what} {count} times (last: {reason})",
                                    {"worker": worker, "doc_id": doc_id, "restarts": count, "reason": reason}))
        return alerts

    def memory(self, resource: str, where: str, used_fraction: float | None) -> list[Alert]:
        """`resource` is "host RAM" or "device memory"; alerts when it crosses the threshold upwards."""
        if used_fraction is None:
            return []
        key = (resource, where)
        if used_fraction <= self.memory_fraction - MEMORY_REARM_MARGIN:
            self._memory_high.discard(key)
        if used_fraction <= self.memory_fraction or key in self._memory_high:
            return []
        self._memory_high.add(key)
        return [Alert("memory", (
            f"{resource} {used_fraction:.0%} used on {where} (alert above {self.memory_fraction:.0%})"
        ), {"resource": resource, "where": where, "used_fraction": round(used_fraction, 4)})]


class AlertMonitor:
    """Thread-safe front of AlertRules for the coordinator: emits to job.log and the console."""

    def __init__(self, log: JobLog, console: Console, rules: AlertRules | None = None) -> None:
        self.log = log
        self.console = console
        self.rules = rules or AlertRules(memory_threshold())
        self._lock = threading.Lock()
        self._host = socket.gethostname()

    def _emit(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            self.log.warning("alert", kind=alert.kind, message=alert.message, **alert.fields)
            self.console.print(f"[yellow]alert ({alert.kind}):[/yellow] {escape(alert.message)}", highlight=False,
                               soft_wrap=True)

    def active(self) -> int:
        """Tasks on a worker right now (the tasks-running gauge)."""
        with self._lock:
            return len(self.rules.running)

    def busy_workers(self) -> int:
        """Workers running a task right now (the progress line's "active workers"; one runs several)."""
        with self._lock:
            return len({run.worker for run in self.rules.running.values()})

    def task_started(self, task_id: str, doc_id: str, n_chars: int, worker: str) -> None:
        with self._lock:
            self.rules.task_started(task_id, doc_id, n_chars, time.monotonic(), worker)

    def task_stopped(self, task_id: str) -> bool:
        """Whether this attempt was already reported as slow."""
        with self._lock:
            run = self.rules.task_stopped(task_id)
        return bool(run and run.alerted)

    def task_finished(self, task_id: str, doc_id: str, n_chars: int, outcome: TaskOutcome,
                      fallbacks: list[str], slow_alerted: bool) -> None:
        where = outcome.get("worker") or "a worker"
        with self._lock:
            alerts = self.rules.task_finished(task_id, doc_id, n_chars, outcome.get("wall_s"), fallbacks,
                                              slow_alerted)
            alerts += self.rules.memory("host RAM", where.split(":")[0], outcome.get("host_used_fraction"))
            alerts += self.rules.memory("device memory", where, outcome.get("device_used_fraction"))
        self._emit(alerts)

    def worker_restarted(self, worker: str, reason: str, doc_id: str | None = None) -> None:
        with self._lock:
            alerts = self.rules.worker_restarted(worker, reason, doc_id)
        self._emit(alerts)

    def check(self) -> None:
        """One watchdog round: overdue tasks, and this machine's RAM."""
        with self._lock:
            alerts = self.rules.overdue(time.monotonic())
            alerts += self.rules.memory("host RAM", self._host, psutil.virtual_memory().percent / 100)
        self._emit(alerts)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Runs `check` every WATCH_INTERVAL_S in a background thread while the block runs."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(WATCH_INTERVAL_S):
                self.check()

        thread = threading.Thread(target=loop, name="alert-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
