"""Sweeping scratch dirs on nodes that join a batch: a node back from a crash still holds the
task dirs of the workers it lost, and nothing else would run on it to remove them.

Every node is swept once when the batch starts (nodes may have come back while no batch ran),
then each node that joins while it runs, and every node again when the batch ends (a worker lost
near the end may not have been restarted to sweep its own dir). The sweep is a zero-CPU Ray task
pinned to the node, so it runs even where every CPU is taken by workers.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from runner.observe.joblog import JobLog
from storage.scratch import sweep_orphans

POLL_S = 2.0
"""How often the node list is read for newcomers."""


def _sweep_here(offload_root: str) -> dict[str, Any]:
    swept = sweep_orphans(Path(offload_root))
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "dirs": [str(d.path) for d in swept],
        "bytes_freed": sum(d.bytes_freed for d in swept),
    }


def _alive_nodes() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


class NodeSweeper:
    """A background thread that sweeps each node once, as it appears; logs `node_swept` to job.log
    (a warning when it removed something)."""

    def __init__(self, offload_root: Path, log: JobLog, poll_s: float = POLL_S) -> None:
        self.offload_root = str(offload_root)
        self.log = log
        self.poll_s = poll_s
        self._swept: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="node-sweeper", daemon=True)
        self._remote = ray.remote(num_cpus=0, max_retries=0)(_sweep_here)

    def _sweep(self, node_ids: set[str]) -> None:
        """Sweep these nodes, each once per call; a failure is logged, not retried."""
        pending = {
            node_id: self._remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
            ).remote(self.offload_root)
            for node_id in node_ids
        }
        for node_id, ref in pending.items():
            self._swept.add(node_id)
            try:
                swept = ray.get(ref, timeout=60)
            except Exception as e:  # a node that left again, or a root that is not kvbatch's: say so, go on
                self.log.warning("node_sweep_failed", node_id=node_id, error=f"{type(e).__name__}: {e}")
                continue
            (self.log.warning if swept["dirs"] else self.log.info)("node_swept", **swept)

    def _watch(self) -> None:
        while True:
            try:
                self._sweep(_alive_nodes() - self._swept)
            except Exception as e:  # the watcher must never take the batch down
                self.log.warning("node_sweep_failed", error=f"{type(e).__name__}: {e}")
            if self._stop.wait(self.poll_s):
                return

    def __enter__(self) -> NodeSweeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=70)
        try:
            self._sweep(_alive_nodes())
        except Exception as e:
            self.log.warning("node_sweep_failed", error=f"{type(e).__name__}: {e}")
