"""`kvbatch status`: what a job is doing, from its folder alone (works while it runs, and after).

Everything comes from files a running coordinator publishes atomically, so another shell or machine can
watch a batch without Ray. `status --json` prints `job_status`'s figures in `JobStatus`'s key order (docs/status.md).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from typing import Any, TypedDict

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jobs.fallback import Fallback
from jobs.outcome import add_steps, no_steps, static_share
from jobs.schema import TaskState
from runner.observe.joblog import read_log
from runner.observe.progress import format_duration, format_eta
from storage.checkpoint import load_state
from storage.jobdir import JobDir, read_job, read_manifest_table
from storage.location import Where
from storage.lock import lock_holder
from storage.owner import OwnerLiveness
from storage.parts import CORRUPT_PART_ADVICE

RECENT_ALERTS = 5


class StateCounts(TypedDict):
    pending: int  # in the manifest, neither finished nor on a worker
    running: int  # on a worker now (only while a coordinator holds the job)
    done: int
    failed: int
    rejected: int  # refused at submit: never in the manifest


class BatchOccupancy(TypedDict):
    mean_sequences: float | None  # sequences sharing a done document's decode steps, on average
    padding_share: float | None  # the padded share of them (0: ragged steps); None before parts had it
    static_step_share: float | None  # done documents' decode row-steps through the static step, of all; None: none
    static_row_steps: int  # those row-steps (job.log's task_done lines)
    eager_row_steps: dict[str, int]  # the others, by why they ran eagerly (runner.engine.static_step.Eager)
    ahead_row_steps: int  # of the static ones, launched before the step before was read


class FallbackCounts(TypedDict):
    tasks: int  # result rows that fell back at least once
    total: int  # moves, all rows together
    by_kind: dict[str, int]  # moves per jobs.fallback.FallbackKind value


class RunningTask(TypedDict):
    task_id: str
    doc_id: str | None
    attempt: int
    state: str  # TaskState: running or retrying
    context_tokens: int
    since_s: float  # since its latest event


class SlowTask(TypedDict):
    doc_id: str
    task_id: str
    wall_s: float
    input_tokens: int
    cache_strategy: str | None


class RecentAlert(TypedDict):
    ts: float
    kind: str | None
    message: str | None


class AlertCounts(TypedDict):
    total: int
    by_kind: dict[str | None, int]
    recent: list[RecentAlert]  # the latest RECENT_ALERTS, oldest first


class JobStatus(TypedDict):
    """What `status` shows and `status --json` prints, in this key order (README.md "Watching a batch")."""

    job_id: str
    job_dir: str
    created: float
    coordinator: str | None  # "pid N on host H" while a live coordinator holds the lock
    total: int  # manifest rows and rejected documents
    counts: StateCounts
    run_started: float  # when the latest run's documents began, as its progress bar counts (docs/status.md)
    run_elapsed_s: float
    throughput_docs_per_s: float  # this run's finished documents per second
    tokens_per_s: float  # this run's output tokens per second
    output_tokens: int  # of every done document
    eta_s: float | None  # 0.0 when nothing is left; None when unknown or not running
    strategies: dict[str, int]  # done documents per cache strategy
    quantization: dict[str, int]  # done documents per weights' method
    stop_reasons: dict[str, int]  # done documents per stop_reason
    batch: BatchOccupancy
    fallbacks: FallbackCounts
    running: list[RunningTask]  # the longest-running first
    slowest: list[SlowTask]  # done documents, the slowest first
    alerts: AlertCounts
    corrupt_parts: list[str]  # parts that did not read (skipped)
    as_of: float


def _running(events: pa.Table, finished: set[str], doc_ids: dict[str, str], now: float) -> list[RunningTask]:
    """Tasks whose latest event (events are in write order) says a worker has them, with no result row yet."""
    columns = ["task_id", "attempt", "state", "ts", "context_tokens"]
    last = {row["task_id"]: row for row in events.select(columns).to_pylist()}
    running: list[RunningTask] = [
        {"task_id": task_id, "doc_id": doc_ids.get(task_id), "attempt": ev["attempt"], "state": ev["state"],
         "context_tokens": ev["context_tokens"], "since_s": round(now - ev["ts"], 3)}
        for task_id, ev in last.items()
        if ev["state"] in (TaskState.RUNNING, TaskState.RETRYING) and task_id not in finished
    ]
    return sorted(running, key=lambda r: r["since_s"], reverse=True)


def _state_counts(results: pa.Table, manifest_rows: int, running: int) -> StateCounts:
    counts = Counter(results["status"].to_pylist())
    done, failed, rejected = (counts.get(s, 0) for s in (TaskState.DONE, TaskState.FAILED, TaskState.REJECTED))
    pending = max(manifest_rows - done - failed - running, 0)
    return {"pending": pending, "running": running, "done": done, "failed": failed, "rejected": rejected}


def _run_started(log: list[dict[str, Any]], created: float) -> float:
    """When the latest coordinator run's documents began (its workers ready): where its progress bar counts
    elapsed from, as its `progress` lines in job.log say (`ts - elapsed_s`); while its workers start, its
    `batch_start`; before any run, the job's creation. Throughput and ETA are this run's, not the job's."""
    started, bar_started = created, None
    for event in log:
        if event.get("event") == "batch_start":
            started, bar_started = event["ts"], None
        elif event.get("event") == "progress" and bar_started is None and event.get("elapsed_s") is not None:
            bar_started = event["ts"] - event["elapsed_s"]
    return bar_started if bar_started is not None else started


def _run_pace(results: pa.Table, started: float, running_until: float | None) -> tuple[float, float, float]:
    """Elapsed s, docs/s and tokens/s of the rows this run finished; `running_until`: now while a
    coordinator runs, else None (the run ended with its last row)."""
    finished_at = results["finished_at"]
    this_run = results.filter(pc.and_(
        pc.greater_equal(finished_at, started),
        pc.is_in(results["status"], pa.array([TaskState.DONE.value, TaskState.FAILED.value])),
    ))
    end = running_until if running_until is not None else (pc.max(finished_at).as_py() or started)
    elapsed = max(end - started, 0.0)
    tokens = pc.sum(this_run["output_tokens"]).as_py() or 0
    return elapsed, this_run.num_rows / elapsed if elapsed > 0 else 0.0, tokens / elapsed if elapsed > 0 else 0.0


def _eta(counts: StateCounts, docs_per_s: float, running: bool) -> float | None:
    """Seconds left at this run's pace: 0.0 with nothing left, None without a pace or a coordinator."""
    remaining = counts["pending"] + counts["running"]
    if not remaining:
        return 0.0
    return remaining / docs_per_s if docs_per_s > 0 and running else None


def _column_counts(rows: pa.Table, column: str) -> dict[str, int]:
    """How many rows hold each value of `column` (none of them in parts written before it existed)."""
    return dict(Counter(v for v in rows[column].to_pylist() if v)) if column in rows.schema.names else {}


def _batch_occupancy(done_rows: pa.Table, log: list[dict[str, Any]]) -> BatchOccupancy:
    """Mean sequences sharing a document's decode steps, and the padded share of them (older parts: null);
    the decode row-steps of the documents done, through the static step or eagerly and why (job.log)."""
    def mean(column: str) -> float | None:
        values = [v for v in done_rows[column].to_pylist() if v is not None] if column in done_rows.schema.names else []
        return sum(values) / len(values) if values else None

    steps = no_steps()
    for e in log:
        if e.get("event") == "task_done" and e.get("decode_row_steps"):
            steps = add_steps(steps, e["decode_row_steps"])
    return {"mean_sequences": mean("batch_size"), "padding_share": mean("padding_share"),
            "static_step_share": static_share(steps), "static_row_steps": steps["static"],
            "eager_row_steps": steps["eager"], "ahead_row_steps": steps["ahead"]}


def _fallback_counts(notes_per_row: list[list[str] | None]) -> FallbackCounts:
    kinds = Counter(Fallback.parse(note).kind.value for notes in notes_per_row for note in notes or [])
    return {"tasks": sum(1 for notes in notes_per_row if notes), "total": sum(kinds.values()), "by_kind": dict(kinds)}


def _slowest(done_rows: pa.Table, limit: int) -> list[SlowTask]:
    rows = done_rows.select(["doc_id", "task_id", "wall_s", "input_tokens", "cache_strategy"]).to_pylist()
    return sorted((r for r in rows if r["wall_s"] is not None), key=lambda r: r["wall_s"], reverse=True)[:limit]


def _alert_counts(log: list[dict[str, Any]]) -> AlertCounts:
    alerts = [e for e in log if e.get("event") == "alert"]
    return {"total": len(alerts), "by_kind": dict(Counter(a.get("kind") for a in alerts)),
            "recent": [{"ts": a["ts"], "kind": a.get("kind"), "message": a.get("message")}
                       for a in alerts[-RECENT_ALERTS:]]}


def job_status(job_dir: Where, slowest: int = 5) -> JobStatus:
    """The figures `status` shows; also what `status --json` prints."""
    job = JobDir(job_dir)
    info = read_job(job)
    manifest = read_manifest_table(job)
    state = load_state(job.path)
    log = read_log(job.log)
    now = time.time()
    holder = lock_holder(job.lock)  # read only: never touches the lock
    if holder is not None and holder.liveness() not in (OwnerLiveness.ALIVE, OwnerLiveness.OTHER_HOST):
        holder = None  # no live coordinator holds the job
    results = state.results
    running = [] if holder is None else _running(
        state.events, set(results["task_id"].to_pylist()),
        dict(zip(manifest["task_id"].to_pylist(), manifest["doc_id"].to_pylist())), now)
    counts = _state_counts(results, manifest.num_rows, len(running))
    started = _run_started(log, info.created)
    elapsed, docs_per_s, tokens_per_s = _run_pace(results, started, now if holder is not None else None)
    done_rows = results.filter(pc.equal(results["status"], TaskState.DONE.value))
    return {
        "job_id": info.job_id,
        "job_dir": str(job.path),
        "created": info.created,
        "coordinator": holder.describe() if holder else None,
        "total": manifest.num_rows + counts["rejected"],
        "counts": counts,
        "run_started": started,
        "run_elapsed_s": round(elapsed, 3),
        "throughput_docs_per_s": docs_per_s,
        "tokens_per_s": tokens_per_s,
        "output_tokens": pc.sum(done_rows["output_tokens"]).as_py() or 0,
        "eta_s": _eta(counts, docs_per_s, holder is not None),
        "strategies": _column_counts(done_rows, "cache_strategy"),
        "quantization": _column_counts(done_rows, "quantization"),
        "stop_reasons": _column_counts(done_rows, "stop_reason"),
        "batch": _batch_occupancy(done_rows, log),
        "fallbacks": _fallback_counts(results["fallbacks"].to_pylist()),
        "running": running,
        "slowest": _slowest(done_rows, slowest),
        "alerts": _alert_counts(log),
        "corrupt_parts": [str(p) for p in state.corrupt],
        "as_of": now,
    }


def print_status(status: JobStatus, console: Console) -> None:
    """`kvbatch status`'s lines: the figures of `job_status` for a person."""
    say = functools.partial(console.print, highlight=False, soft_wrap=True)
    c = status["counts"]
    where = f"running ({status['coordinator']})" if status["coordinator"] else "not running"
    say(f"job {status['job_id']}  ({escape(status['job_dir'])})  {escape(where)}")
    say(f"total {status['total']}: done {c['done']}, running {c['running']}, pending {c['pending']}, "
        f"failed {c['failed']}, rejected {c['rejected']}")
    fb = status["fallbacks"]
    say(f"this run: {status['throughput_docs_per_s'] * 60:.2f} docs/min, {status['tokens_per_s']:.1f} tok/s, "
        f"elapsed {format_duration(status['run_elapsed_s'])}, "
        f"ETA {format_eta(status['eta_s']) if status['coordinator'] else format_duration(status['eta_s'])}; "
        f"fallbacks {fb['total']} in {fb['tasks']} task(s)")
    batch = status["batch"]
    if batch["mean_sequences"] is not None:
        say(f"batch occupancy: {batch['mean_sequences']:.1f} sequences per decode step on average, "
            f"{batch['padding_share']:.0%} padding")
    if batch["static_step_share"] is not None:
        eager = ", ".join(f"{why} {n}" for why, n in batch["eager_row_steps"].items())
        say(f"static step: {batch['static_step_share']:.1%} of decode row-steps ({batch['static_row_steps']}); "
            f"off it {sum(batch['eager_row_steps'].values())}" + (f": {eager}" if eager else ""))
    for key, label in (("strategies", "cache strategies"), ("quantization", "weights"),
                       ("stop_reasons", "summaries ended by")):
        if status[key]:
            say(f"{label}: " + ", ".join(f"{k} {v}" for k, v in status[key].items()))
    if status["running"]:
        table = Table("running", "attempt", "for", "context")
        for r in status["running"]:
            table.add_row(escape(r["doc_id"] or r["task_id"]), str(r["attempt"]), format_duration(r["since_s"]),
                          str(r["context_tokens"]))
        console.print(table)
    if status["slowest"]:
        table = Table("slowest documents", "wall s", "input tokens", "cache")
        for r in status["slowest"]:
            table.add_row(escape(r["doc_id"]), f"{r['wall_s']:.1f}", str(r["input_tokens"]), r["cache_strategy"] or "")
        console.print(table)
    alerts = status["alerts"]
    if alerts["total"]:
        console.print(f"[yellow]{alerts['total']} alert(s)[/yellow] in job.log; latest:")
        for a in alerts["recent"]:
            say(f"  {a['kind']}: {escape(a['message'] or '')}")
    for part in status["corrupt_parts"]:
        console.print(f"[yellow]damaged part skipped: {escape(part)}")
    if status["corrupt_parts"]:
        console.print(f"  {CORRUPT_PART_ADVICE}", highlight=False)
