"""Batch metrics for a Ray cluster's own Prometheus endpoint (docs/status.md, "Ray metrics").

Recorded by the coordinator, which sees every task's final outcome once; Ray exports them from each
node's metrics agent, so a cluster's existing Prometheus/Grafana setup needs no other exporter.
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from jobs.fallback import Fallback

_TASK_SECONDS_BOUNDARIES = [1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600]


class BatchMetrics:
    """Counters and gauges of one coordinator; every series is tagged with the job id."""

    def __init__(self, job_id: str) -> None:
        self._tags = {"job_id": job_id}
        self.tasks = Counter("kvbatch_tasks", "Tasks finished, by final status and cache strategy",
                             tag_keys=("job_id", "status", "strategy"))
        self.tokens = Counter("kvbatch_tokens", "Input and output tokens of done tasks",
                              tag_keys=("job_id", "kind"))
        self.fallbacks = Counter("kvbatch_fallbacks", "Fallbacks taken, by kind (cache rung or context size)",
                                 tag_keys=("job_id", "kind"))
        self.kv_offload = Counter("kvbatch_kv_offload_bytes", "KV cache bytes written to / read from offload dirs",
                                  tag_keys=("job_id", "direction"))
        self.worker_restarts = Counter("kvbatch_worker_restarts", "Worker actors restarted (died or hung)",
                                       tag_keys=("job_id",))
        self.running = Gauge("kvbatch_tasks_running", "Tasks on a worker right now", tag_keys=("job_id",))
        self.task_seconds = Histogram("kvbatch_task_seconds", "Wall time of finished tasks",
                                      boundaries=_TASK_SECONDS_BOUNDARIES, tag_keys=("job_id", "strategy"))

    def task_finished(self, row: dict[str, Any]) -> None:
        strategy = row.get("cache_strategy") or "none"
        self.tasks.inc(1, {**self._tags, "status": row["status"], "strategy": strategy})
        for kind in ("input", "output"):
            if row.get(f"{kind}_tokens"):
                self.tokens.inc(row[f"{kind}_tokens"], {**self._tags, "kind": kind})
        for note in row.get("fallbacks") or []:
            self.fallbacks.inc(1, {**self._tags, "kind": Fallback.parse(note).kind.value})
        for direction, key in (("written", "offload_bytes_written"), ("read", "offload_bytes_read")):
            if row.get(key):
                self.kv_offload.inc(row[key], {**self._tags, "direction": direction})
        if row.get("wall_s") is not None:
            self.task_seconds.observe(row["wall_s"], {**self._tags, "strategy": strategy})

    def worker_restarted(self) -> None:
        self.worker_restarts.inc(1, self._tags)

    def set_running(self, count: int) -> None:
        self.running.set(count, self._tags)
