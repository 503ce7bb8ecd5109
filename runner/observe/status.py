"""`kvbatch status`: what a job is doing, from its folder alone (works while it runs, and after).

Everything comes from files a running coordinator publishes atomically (results/ and events/
parts, job.log, .lock), so another shell, or another machine on shared storage, can watch a batch
without talking to Ray. `job_status` returns the figures `status --json` prints; docs/status.md
documents its keys.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jobs.schema import TaskState
from runner.observe.joblog import read_log
from runner.observe.progress import format_duration
from storage.checkpoint import load_state
from storage.jobdir import JobDir, read_job, read_manifest_table
from storage.location import Where
from storage.lock import lock_holder
from storage.owner import OwnerLiveness, ProcessOwner
from storage.parts import CORRUPT_PART_ADVICE

RECENT_ALERTS = 5


def coordinator_holding(job: JobDir) -> ProcessOwner | None:
    """The live coordinator that holds the job's lock, if any (read only: never touches the lock)."""
    owner = lock_holder(job.lock)
    if owner is None:
        return None
    return owner if owner.liveness() in (OwnerLiveness.ALIVE, OwnerLiveness.OTHER_HOST) else None


def _last_events(events: pa.Table) -> dict[str, dict[str, Any]]:
    """Each task's latest event (events are in write order)."""
    last: dict[str, dict[str, Any]] = {}
    for row in events.select(["task_id", "attempt", "state", "ts", "context_tokens"]).to_pylist():
        last[row["task_id"]] = row
    return last


def _run_started(log: list[dict[str, Any]], created: float) -> float:
    """When the latest coordinator run began: throughput and ETA are this run's, not the job's."""
    starts = [e["ts"] for e in log if e.get("event") == "batch_start"]
    return max(starts) if starts else created


def _fallback_kinds(fallbacks: list[list[str] | None]) -> dict[str, int]:
    return dict(Counter(note.split(":", 1)[0] for notes in fallbacks for note in notes or []))


def _column_counts(rows: pa.Table, column: str) -> dict[str, int]:
    """How many rows hold each value of `column` (none of them in parts written before it existed)."""
    return dict(Counter(v for v in rows[column].to_pylist() if v)) if column in rows.schema.names else {}


def _batch_occupancy(done_rows: pa.Table) -> dict[str, float | None]:
    """Mean sequences sharing a document's decode steps, and the padded share of them (older parts: null)."""
    def mean(column: str) -> float | None:
        values = [v for v in done_rows[column].to_pylist() if v is not None] if column in done_rows.schema.names else []
        return sum(values) / len(values) if values else None

    return {"mean_sequences": mean("batch_size"), "padding_share": mean("padding_share")}


def job_status(job_dir: Where, slowest: int = 5) -> dict[str, Any]:
    """The figures `status` shows; also the documented keys of `status --json`."""
    job = JobDir(job_dir)
    info = read_job(job)
    manifest = read_manifest_table(job)
    doc_ids = dict(zip(manifest["task_id"].to_pylist(), manifest["doc_id"].to_pylist()))
    state = load_state(job.path)
    log = read_log(job.log)
    now = time.time()
    holder = coordinator_holding(job)
    results = state.results
    finished = set(results["task_id"].to_pylist())
    running = []
    if holder is not None:
        for task_id, ev in _last_events(state.events).items():
            if ev["state"] in (TaskState.RUNNING, TaskState.RETRYING) and task_id not in finished:
                running.append({
                    "task_id": task_id, "doc_id": doc_ids.get(task_id), "attempt": ev["attempt"],
                    "state": ev["state"], "context_tokens": ev["context_tokens"],
                    "since_s": round(now - ev["ts"], 3),
                })
        running.sort(key=lambda r: r["since_s"], reverse=True)
    counts = Counter(results["status"].to_pylist())
    done, failed, rejected = (counts.get(s, 0) for s in (TaskState.DONE, TaskState.FAILED, TaskState.REJECTED))
    pending = max(manifest.num_rows - done - failed - len(running), 0)

    run_started = _run_started(log, info.created)
    finished_at = results["finished_at"]
    this_run = results.filter(pc.and_(
        pc.greater_equal(finished_at, run_started),
        pc.is_in(results["status"], pa.array([TaskState.DONE.value, TaskState.FAILED.value])),
    ))
    run_end = now if holder is not None else (pc.max(finished_at).as_py() or run_started)
    run_elapsed = max(run_end - run_started, 0.0)
    throughput = this_run.num_rows / run_elapsed if run_elapsed > 0 else 0.0
    run_tokens = pc.sum(this_run["output_tokens"]).as_py() or 0
    remaining = pending + len(running)
    eta = 0.0 if not remaining else (remaining / throughput if throughput > 0 and holder else None)

    done_rows = results.filter(pc.equal(results["status"], TaskState.DONE.value))
    slow = sorted(
        (r for r in done_rows.select(["doc_id", "task_id", "wall_s", "input_tokens", "cache_strategy"]).to_pylist()
         if r["wall_s"] is not None),
        key=lambda r: r["wall_s"], reverse=True,
    )[:slowest]
    fallback_lists = results["fallbacks"].to_pylist()
    alerts = [e for e in log if e.get("event") == "alert"]
    return {
        "job_id": info.job_id,
        "job_dir": str(job.path),
        "created": info.created,
        "coordinator": holder.describe() if holder else None,
        "total": manifest.num_rows + rejected,
        "counts": {"pending": pending, "running": len(running), "done": done, "failed": failed,
                   "rejected": rejected},
        "run_started": run_started,
        "run_elapsed_s": round(run_elapsed, 3),
        "throughput_docs_per_s": throughput,
        "tokens_per_s": run_tokens / run_elapsed if run_elapsed > 0 else 0.0,
        "output_tokens": pc.sum(done_rows["output_tokens"]).as_py() or 0,
        "eta_s": eta,
        "strategies": dict(Counter(s for s in done_rows["cache_strategy"].to_pylist() if s)),
        "quantization": _column_counts(done_rows, "quantization"),
        "stop_reasons": _column_counts(done_rows, "stop_reason"),
        "batch": _batch_occupancy(done_rows),
        "fallbacks": {"tasks": sum(1 for fs in fallback_lists if fs),
                      "total": sum(len(fs or []) for fs in fallback_lists),
                      "by_kind": _fallback_kinds(fallback_lists)},
        "running": running,
        "slowest": slow,
        "alerts": {"total": len(alerts), "by_kind": dict(Counter(a.get("kind") for a in alerts)),
                   "recent": [{"ts": a["ts"], "kind": a.get("kind"), "message": a.get("message")}
                              for a in alerts[-RECENT_ALERTS:]]},
        "corrupt_parts": [str(p) for p in state.corrupt],
        "as_of": now,
    }


def print_status(status: dict[str, Any], console: Console) -> None:
    c = status["counts"]
    where = f"running ({status['coordinator']})" if status["coordinator"] else "not running"
    console.print(f"job {status['job_id']}  ({status['job_dir']})  {where}", highlight=False, soft_wrap=True)
    console.print(
        f"total {status['total']}: done {c['done']}, running {c['running']}, pending {c['pending']}, "
        f"failed {c['failed']}, rejected {c['rejected']}", highlight=False, soft_wrap=True,
    )
    fb = status["fallbacks"]
    console.print(
        f"this run: {status['throughput_docs_per_s'] * 60:.2f} docs/min, {status['tokens_per_s']:.1f} tok/s, "
        f"elapsed {format_duration(status['run_elapsed_s'])}, ETA {format_duration(status['eta_s'])}; "
        f"fallbacks {fb['total']} in {fb['tasks']} task(s)", highlight=False, soft_wrap=True,
    )
    batch = status["batch"]
    if batch["mean_sequences"] is not None:
        console.print(f"batch occupancy: {batch['mean_sequences']:.1f} sequences per decode step on average, "
                      f"{batch['padding_share']:.0%} padding", highlight=False, soft_wrap=True)
    if status["strategies"]:
        console.print("cache strategies: " + ", ".join(f"{k} {v}" for k, v in status["strategies"].items()),
                      highlight=False, soft_wrap=True)
    if status["quantization"]:
        console.print("weights: " + ", ".join(f"{k} {v}" for k, v in status["quantization"].items()),
                      highlight=False, soft_wrap=True)
    if status["stop_reasons"]:
        console.print("summaries ended by: " + ", ".join(f"{k} {v}" for k, v in status["stop_reasons"].items()),
                      highlight=False, soft_wrap=True)
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
            console.print(f"  {a['kind']}: {escape(a['message'] or '')}", highlight=False, soft_wrap=True)
    for part in status["corrupt_parts"]:
        console.print(f"[yellow]damaged part skipped: {escape(part)}")
    if status["corrupt_parts"]:
        console.print(f"  {CORRUPT_PART_ADVICE}", highlight=False)
