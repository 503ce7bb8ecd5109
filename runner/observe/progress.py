"""Live progress: a rich bar on a terminal, plain periodic lines otherwise (CI logs stay readable).

Both show documents done/failed/total, output tokens/s, ETA, active workers and fallbacks so far.
A background ticker refreshes them while nothing finishes (a batch of long documents can go
minutes between results); `$KVBATCH_PROGRESS_INTERVAL_S` sets how often a plain line is printed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

INTERVAL_ENV = "KVBATCH_PROGRESS_INTERVAL_S"
DEFAULT_PLAIN_INTERVAL_S = 10.0
BAR_REFRESH_S = 1.0


def plain_interval() -> float:
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_PLAIN_INTERVAL_S
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: expected seconds, such as 10") from None
    if value <= 0:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: expected a positive number of seconds")
    return value


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class BatchProgress:
    """Counts of this run; thread-safe since worker threads report into it."""

    def __init__(self, console: Console, total: int, already_done: int, workers: int,
                 active: Callable[[], int] | None = None, plain_interval_s: float | None = None) -> None:
        self.console = console
        self.total = total
        self.done = already_done
        self.done_this_run = 0
        self.failed = 0
        self.fallbacks = 0
        self.tokens = 0
        self.workers = workers
        self._active = active or (lambda: workers)
        self._started = time.monotonic()
        self._lock = threading.RLock()
        self._interval_s = plain_interval_s or plain_interval()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]documents"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task("batch", total=total, completed=already_done, detail="")

    def __enter__(self) -> "BatchProgress":
        if self._bar:
            self._bar.start()
            self._refresh()
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ticker.join()
        if self._bar:
            self._refresh()
            self._bar.stop()
        else:
            self._plain_line()

    def tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self._started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        """From this run's rate (documents finished before a resume do not count as speed)."""
        remaining = self.total - self.done
        if remaining <= 0:
            return 0.0
        if not self.done_this_run:
            return None
        return remaining * (time.monotonic() - self._started) / self.done_this_run

    def _detail(self) -> str:
        return (
            f"failed {self.failed}  fallbacks {self.fallbacks}  active {self._active()}/{self.workers} workers  "
            f"{self.tokens_per_s():.1f} tok/s  ETA {format_duration(self.eta_s())}"
        )

    def record(self, status: str, output_tokens: int, fallbacks: int) -> None:
        with self._lock:
            self.done += 1
            self.done_this_run += 1
            self.failed += status == "failed"
            self.tokens += output_tokens
            self.fallbacks += fallbacks
            if self._bar:
                self._refresh()

    def _refresh(self) -> None:
        with self._lock:
            self._bar.update(self._task, completed=self.done, detail=self._detail())

    def _tick(self) -> None:
        interval = BAR_REFRESH_S if self._bar else self._interval_s
        while not self._stop.wait(interval):
            if self._bar:
                self._refresh()
            else:
                self._plain_line()

    def _plain_line(self) -> None:
        with self._lock:
            line = f"progress: {self.done}/{self.total} documents  {self._detail()}"
        self.console.print(line, highlight=False, soft_wrap=True)
