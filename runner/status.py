"""`kvbatch status`: what a job is doing, from its folder alone (works while it runs, and after)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from jobs.schema import TaskState
from storage.checkpoint import load_state
from storage.jobdir import JobDir, read_job, read_manifest_table


def job_status(job_dir: Path, slowest: int = 5) -> dict[str, Any]:
    """The figures `status` shows; also the documented keys of `status --json`."""
    job = JobDir(job_dir)
    info = read_job(job)
    manifest = read_manifest_table(job)
    state = load_state(job.path)
    results = state.results
    total_tasks = manifest.num_rows
    finished = set(results["task_id"].to_pylist())
    running = set()
    if state.events.num_rows:
        last = {}
        for task_id, st in zip(state.events["task_id"].to_pylist(), state.events["state"].to_pylist()):
            last[task_id] = st
        running = {t for t, st in last.items() if st in (TaskState.RUNNING, TaskState.RETRYING)} - finished
    counts = Counter(results["status"].to_pylist())
    done = counts.get(TaskState.DONE, 0)
    failed = counts.get(TaskState.FAILED, 0)
    finished_tasks = done + failed
    pending = max(total_tasks - finished_tasks - len(running), 0)
    times = [t for t in results["finished_at"].to_pylist() if t is not None]
    elapsed = (max(times) - info.created) if times else 0.0
    throughput = finished_tasks / elapsed if elapsed > 0 else 0.0
    remaining = pending + len(running)
    done_rows = results.filter(pc.equal(results["status"], TaskState.DONE.value))
    slow = sorted(
        (r for r in done_rows.select(["doc_id", "wall_s", "input_tokens", "cache_strategy"]).to_pylist()
         if r["wall_s"] is not None),
        key=lambda r: r["wall_s"], reverse=True,
    )[:slowest]
    fallbacks = [f for fs in results["fallbacks"].to_pylist() for f in (fs or [])]
    tokens = pc.sum(done_rows["output_tokens"]).as_py() or 0
    return {
        "job_id": info.job_id,
        "job_dir": str(job.path),
        "created": info.created,
        "total": total_tasks + counts.get(TaskState.REJECTED, 0),
        "counts": {
            "pending": pending, "running": len(running), "done": done, "failed": failed,
            "rejected": counts.get(TaskState.REJECTED, 0),
        },
        "throughput_docs_per_s": throughput,
        "output_tokens": tokens,
        "eta_s": remaining / throughput if throughput > 0 and remaining else (0.0 if not remaining else None),
        "strategies": dict(Counter(s for s in done_rows["cache_strategy"].to_pylist() if s)),
        "fallbacks": {"tasks": sum(1 for fs in results["fallbacks"].to_pylist() if fs), "total": len(fallbacks)},
        "slowest": slow,
        "corrupt_parts": [str(p) for p in state.corrupt],
        "as_of": time.time(),
    }


def print_status(status: dict[str, Any], console: Console) -> None:
    c = status["counts"]
    console.print(f"job {status['job_id']}  ({status['job_dir']})")
    console.print(
        f"total {status['total']}: done {c['done']}, running {c['running']}, pending {c['pending']}, "
        f"failed {c['failed']}, rejected {c['rejected']}"
    )
    eta = status["eta_s"]
    console.print(
        f"throughput {status['throughput_docs_per_s'] * 60:.2f} docs/min, "
        f"ETA {'unknown' if eta is None else f'{eta:.0f} s'}, "
        f"fallbacks {status['fallbacks']['total']} in {status['fallbacks']['tasks']} task(s)"
    )
    if status["strategies"]:
        console.print("cache strategies: " + ", ".join(f"{k} {v}" for k, v in status["strategies"].items()))
    if status["slowest"]:
        table = Table("slowest documents", "wall s", "input tokens", "cache")
        for r in status["slowest"]:
            table.add_row(r["doc_id"], f"{r['wall_s']:.1f}", str(r["input_tokens"]), r["cache_strategy"] or "")
        console.print(table)
    for part in status["corrupt_parts"]:
        console.print(f"[yellow]damaged part skipped: {part}")
