"""Live progress: a rich bar on a terminal, plain periodic lines otherwise (CI logs stay readable);
what each figure means: docs/status.md "Progress".

Tokens are counted as the workers decode them (asked every second), so long documents show a pace before
the first result; the ETA's rate starts at the first sample with tokens, so worker start-up is no slowness.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Column

from runner.observe.joblog import JobLog

INTERVAL_ENV = "KVBATCH_PROGRESS_INTERVAL_S"
DEFAULT_PLAIN_INTERVAL_S = 10.0
TICK_S = 1.0
#: how often job.log gets a `progress` line while the batch runs
LOG_INTERVAL_S = 5.0
BAR_WIDTH = 10
FIELD_GAP = "  "


def env_number(name: str, default: float, example: str, valid: Callable[[float], bool], expected: str) -> float:
    """$`name` as a number (`default` when unset); a ValueError naming the variable when it is no number
    (`example`) or not `valid` (`expected`)."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {example}") from None
    if not valid(value):
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return value


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_eta(seconds: float | None) -> str:
    """An ETA as shown while a batch runs: `estimating` until a rate is measured."""
    return "estimating" if seconds is None else format_duration(seconds)


def fit_fields(fields: list[str], width: int, kept: int = 2) -> list[str]:
    """The first of `fields` that fit one line of `width` columns whole, two spaces apart; the first `kept`
    always (a field that does not fit ends the line: the details give way, never mid-word)."""
    used = len(FIELD_GAP.join(fields[:kept]))
    for i in range(kept, len(fields)):
        used += len(FIELD_GAP) + len(fields[i])
        if used > width:
            return fields[:i]
    return list(fields)


class BatchProgress:
    """Counts of this run; thread-safe since worker threads report into it. `budgets`: each open task's most
    decode tokens; `busy`: workers running a task now; `decoded`: tokens decoded this run, asked once a tick."""

    def __init__(self, console: Console, total: int, already_done: int, workers: int, budgets: dict[str, int],
                 busy: Callable[[], int], decoded: Callable[[], int],
                 log: JobLog | None = None, plain_interval_s: float | None = None) -> None:
        self.console = console
        self.total = total
        self.done = already_done
        self.done_this_run = 0
        self.failed = 0
        self.fallbacks = 0
        self.finished_tokens = 0  # output tokens of the documents this run finished
        self.decoded_tokens = 0  # decode tokens the workers made this run, as last asked
        self.workers = workers
        self._budgets = budgets
        self._budget_done = 0
        self._busy = busy
        self._decoded = decoded
        self._log = log
        self._started = time.monotonic()
        # (when, tokens) of the first sample that had tokens and of the latest: the measured decode rate
        self._first_sample: tuple[float, int] | None = None
        self._last_sample: tuple[float, int] | None = None
        self._lock = threading.RLock()
        self._interval_s = plain_interval_s or env_number(INTERVAL_ENV, DEFAULT_PLAIN_INTERVAL_S, "seconds, such as 10",
                                                          lambda v: v > 0, "a positive number of seconds")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
        self._bar: Progress | None = None
        if console.is_terminal:
            # one line of whole fields, made to fit the terminal's width at each refresh (_bar_line)
            self._bar = Progress(TextColumn("{task.fields[line]}", table_column=Column(no_wrap=True)),
                                 console=console, transient=False)
            self._task = self._bar.add_task("batch", total=total, completed=already_done, line="")

    def __enter__(self) -> "BatchProgress":
        self._log_sample()  # the run's start, for `kvbatch status` (its elapsed counts from here too)
        if self._bar:
            self._bar.start()
            self._refresh()
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ticker.join()
        self._ask_workers()
        self._log_sample()
        if self._bar:
            self._refresh()
            self._bar.stop()
        else:
            self._plain_line()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def tokens(self) -> int:
        """Tokens made this run: decoded so far, or at least those of the finished summaries."""
        return max(self.decoded_tokens, self.finished_tokens)

    def _sample(self) -> None:
        """Notes this run's tokens now: the decode rate is measured from the first sample with tokens."""
        with self._lock:
            sample = (time.monotonic(), self.tokens())
            if sample[1] <= 0:
                return
            self._first_sample = self._first_sample or sample
            self._last_sample = sample

    def eta_s(self) -> float | None:
        """The tokens the open documents may still decode (their budgets, less what was decoded or freed by a
        document that ended early) at the measured decode rate; None (`estimating`) until there is one."""
        with self._lock:
            remaining = self.total - self.done
            if remaining <= 0:
                return 0.0
            made = self.tokens()
            left = sum(self._budgets.values()) - max(made, self._budget_done)
            if left <= 0:  # the documents outran their budgets (more passes than expected): count documents
                return remaining * self.elapsed_s() / self.done_this_run if self.done_this_run else None
            if self._first_sample is None or self._last_sample is None:
                return None
            (first_at, first), (last_at, last) = self._first_sample, self._last_sample
            if last <= first or last_at <= first_at:
                return None
            return left * (last_at - first_at) / (last - first)

    def _details(self) -> list[str]:
        elapsed = self.elapsed_s()
        tok_s = self.tokens() / elapsed if elapsed > 0 else 0.0
        return [f"{tok_s:.1f} tok/s", f"ETA {format_eta(self.eta_s())}", f"failed {self.failed}",
                f"active {self._busy()}/{self.workers} workers", f"fallbacks {self.fallbacks}"]

    def _head(self) -> list[str]:
        return [f"{self.done}/{self.total} documents", f"elapsed {format_duration(self.elapsed_s())}"]

    def _bar_line(self) -> str:
        """The bar's line for the terminal's width now: counts, elapsed, the bar, then the ETA first of the
        details; each field whole or not at all."""
        tok_s, eta, *rest = self._details()
        fields = fit_fields([*self._head(), "━" * BAR_WIDTH, eta, tok_s, *rest], self.console.width)
        if len(fields) > 2:  # the bar, drawn in the width its field was given
            filled = round(BAR_WIDTH * self.done / self.total) if self.total else BAR_WIDTH
            back = "━" if self.console.color_system else "─"  # without colours a thinner line tells them apart
            fields[2] = f"[bar.complete]{'━' * filled}[/][bar.back]{back * (BAR_WIDTH - filled)}[/]"
        return FIELD_GAP.join(fields)

    def record(self, task_id: str, status: str, output_tokens: int, fallbacks: int) -> None:
        with self._lock:
            self.done += 1
            self.done_this_run += 1
            self.failed += status == "failed"
            self.finished_tokens += output_tokens
            self.fallbacks += fallbacks
            self._budget_done += self._budgets.get(task_id, 0)
            self._sample()
            if self._bar:
                self._refresh()

    def _ask_workers(self) -> None:
        decoded = self._decoded()  # outside the lock: it waits on the workers
        with self._lock:
            self.decoded_tokens = max(self.decoded_tokens, decoded)
            self._sample()

    def _refresh(self) -> None:
        with self._lock:
            self._bar.update(self._task, completed=self.done, line=self._bar_line())

    def _tick(self) -> None:
        last_line = last_log = time.monotonic()
        tick = TICK_S if self._bar else min(TICK_S, self._interval_s)
        while not self._stop.wait(tick):
            self._ask_workers()
            now = time.monotonic()
            if now - last_log >= LOG_INTERVAL_S:
                self._log_sample()
                last_log = now
            if self._bar:
                self._refresh()
            elif now - last_line >= self._interval_s:
                self._plain_line()
                last_line = now

    def _log_sample(self) -> None:
        """One point of the report's throughput over time: this run's decode tokens so far."""
        if self._log is not None:
            with self._lock:
                figures = {"done": self.done, "total": self.total, "decode_tokens": self.tokens(),
                           "elapsed_s": round(self.elapsed_s(), 3)}
            self._log.info("progress", **figures)

    def _plain_line(self) -> None:
        with self._lock:
            line = "progress: " + FIELD_GAP.join([*self._head(), *self._details()])
        self.console.print(line, highlight=False, soft_wrap=True)
