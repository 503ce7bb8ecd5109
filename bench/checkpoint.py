"""Checkpoint cost of a large job: per-task write overhead, state-load time, bytes on disk.

Writes what a run writes for each task (a "running" event, the result row, a "done" event) through
CheckpointLog with the default flush settings, from as many threads as a worker's feeding threads at
`batch.max_sequences` 16 (a result is on disk when `add_result` returns; threads that finish together
share a write), and from one thread (one part per result) for comparison; then loads the state the way
`resume` does, before and after `compact`.
Run: python bench/checkpoint.py [--tasks 5000] [--threads 16] [--single-tasks 300] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from jobs.schema import EVENT_SCHEMA, RESULT_SCHEMA, empty_row
from storage.checkpoint import EVENTS_DIR, RESULTS_DIR, CheckpointLog, compact, load_state
from storage.parts import list_parts

SUMMARY = "The document is a software licence that grants broad rights to use, copy and modify. " * 3


def task_rows(i: int) -> tuple[dict, dict, dict]:
    now = time.time()
    task_id, doc_id = f"t{i:07d}", f"doc-{i:07d}"
    running = {**empty_row(EVENT_SCHEMA), "task_id": task_id, "attempt": 1, "state": "running", "ts": now,
               "worker": "worker-3", "context_tokens": 8192, "cache_strategy": "dynamic"}
    result = {**empty_row(RESULT_SCHEMA), "doc_id": doc_id, "task_id": task_id, "summary": SUMMARY,
              "status": "done", "attempts": 1, "input_tokens": 5000 + i % 3000, "output_tokens": 180,
              "context_tokens": 8192, "chunks": 1, "cache_strategy": "dynamic", "fallbacks": [],
              "ttft_s": 0.8, "decode_tokens_per_s": 41.5, "wall_s": 5.1, "peak_device_bytes": 2**30,
              "peak_host_rss_bytes": 2**31, "kv_bytes": 180 * 2**20, "kv_resident_peak_bytes": 180 * 2**20,
              "offload_bytes_written": 0, "offload_bytes_read": 0, "compression_ratio": None,
              "worker": "worker-3", "model": "builtin:smollm2-135m", "finished_at": now,
              "meta": json.dumps({"source": "bench", "n": i})}
    done = {**running, "state": "done", "ts": now}
    return running, result, done


def write_tasks(job_dir: Path, rows: list[tuple[dict, dict, dict]], threads: int) -> float:
    """Seconds to checkpoint `rows` the way the coordinator's feeding threads do, close included."""

    def feed(mine: list[tuple[dict, dict, dict]]) -> None:
        for running, result, done in mine:
            log.add_event(running)
            log.add_result(result)
            log.add_event(done)

    start = time.perf_counter()
    with CheckpointLog(job_dir) as log:
        feeders = [threading.Thread(target=feed, args=(rows[i::threads],)) for i in range(threads)]
        for feeder in feeders:
            feeder.start()
        for feeder in feeders:
            feeder.join()
    return time.perf_counter() - start


def disk_usage(job_dir: Path) -> tuple[int, int]:
    parts = list_parts(job_dir / EVENTS_DIR) + list_parts(job_dir / RESULTS_DIR)
    return len(parts), sum(part.size() for part in parts)


def timed_load(job_dir: Path, n_tasks: int) -> float:
    start = time.perf_counter()
    state = load_state(job_dir)
    elapsed = time.perf_counter() - start
    assert len(state.done_task_ids) == n_tasks and state.events.num_rows == 2 * n_tasks and not state.corrupt
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5_000)
    parser.add_argument("--threads", type=int, default=16, help="feeding threads that finish tasks together")
    parser.add_argument("--single-tasks", type=int, default=300,
                        help="tasks for the one-thread comparison (one part per result is slow)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the job (default: a temp dir)")
    args = parser.parse_args()

    rows = [task_rows(i) for i in range(args.tasks)]  # built outside the timing: the run has them anyway
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        n_single = min(args.single_tasks, args.tasks)
        single_s = write_tasks(Path(tmp), rows[:n_single], threads=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        job_dir = Path(tmp)
        write_s = write_tasks(job_dir, rows, threads=args.threads)
        parts_before, bytes_before = disk_usage(job_dir)
        load_before = timed_load(job_dir, args.tasks)

        start = time.perf_counter()
        compact(job_dir)
        compact_s = time.perf_counter() - start
        parts_after, bytes_after = disk_usage(job_dir)
        load_after = timed_load(job_dir, args.tasks)

    per_task_ms = write_s / args.tasks * 1e3
    single_ms = single_s / n_single * 1e3
    print(f"{args.tasks:,} tasks, 3 rows each, from {args.threads} threads; each result on disk when add_result returns")
    print(f"{'':24}{'before compact':>16}{'after compact':>16}{'after/before':>14}")
    print(f"{'parts on disk':24}{parts_before:>16,}{parts_after:>16,}{parts_after / parts_before:>14.3f}")
    print(f"{'bytes on disk':24}{bytes_before:>16,}{bytes_after:>16,}{bytes_after / bytes_before:>14.3f}")
    print(f"{'state load (s)':24}{load_before:>16.3f}{load_after:>16.3f}{load_after / load_before:>14.3f}")
    print(f"checkpoint overhead per task: {per_task_ms:.3f} ms ({write_s:.1f} s for all tasks; a task's feeding "
          f"thread waits that long for its result to be on disk, once per document)")
    print(f"  vs one thread (one part per result, {n_single:,} tasks): {single_ms:.3f} ms per task; "
          f"{args.threads} threads/one = {per_task_ms / single_ms:.3f}")
    print(f"compaction: {compact_s:.2f} s; state load target < 3 s: "
          f"{'met' if max(load_before, load_after) < 3 else 'MISSED'}")


if __name__ == "__main__":
    main()
