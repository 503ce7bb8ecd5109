"""Live progress: a rich bar on a terminal, plain periodic lines otherwise (CI logs stay readable)."""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class BatchProgress:
    """Counts of this run; thread-safe since worker threads report into it."""

    def __init__(self, console: Console, total: int, already_done: int, workers: int,
                 plain_interval_s: float = 10.0) -> None:
        self.console = console
        self.total = total
        self.done = already_done
        self.failed = 0
        self.fallbacks = 0
        self.tokens = 0
        self.workers = workers
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._plain_interval_s = plain_interval_s
        self._last_plain = 0.0
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]documents"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task("batch", total=total, completed=already_done, detail="")

    def __enter__(self) -> "BatchProgress":
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar:
            self._bar.stop()
        else:
            self._plain_line(force=True)

    def tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self._started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def _detail(self) -> str:
        return (
            f"failed {self.failed}  fallbacks {self.fallbacks}  workers {self.workers}  "
            f"{self.tokens_per_s():.1f} tok/s"
        )

    def record(self, status: str, output_tokens: int, fallbacks: int) -> None:
        with self._lock:
            self.done += 1
            self.failed += status == "failed"
            self.tokens += output_tokens
            self.fallbacks += fallbacks
            if self._bar:
                self._bar.update(self._task, completed=self.done, detail=self._detail())
            else:
                self._plain_line()

    def _plain_line(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_plain < self._plain_interval_s and self.done < self.total:
            return
        self._last_plain = now
        self.console.print(f"progress: {self.done}/{self.total} documents  {self._detail()}")
