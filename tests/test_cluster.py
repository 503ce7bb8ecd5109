"""A batch on a real multi-node Ray cluster on this machine: workers on every node, and a node lost mid-batch.

The cluster (`ray.cluster_utils.Cluster`: a head without CPUs for work, like a real head node, and
three 1-CPU worker nodes) lives in a child process of its own, with a private RAY_TMPDIR: Cluster
writes its address where a plain `ray.init()` looks for one, and it must not capture the other
tests' (or other sessions') local Ray instances. The child takes "remove NODE_ID" lines on stdin.
Every node shares this host, so a worker's node is found from its process: Ray starts workers
as children of their node's raylet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from tests.helpers.child_process import Child
from tests.helpers.cli import REPO, TINY_CONFIG, export_rows, kvbatch, license_manifest, start_submit, wait_for

#: Longest first: the coordinator takes the longest open task first, so Apache-2.0 starts at once.
DOCS = ["Apache-2.0", "LGPL-3", "CC0-1.0", "Artistic", "BSD"]
WORKER_NODES = 3

#: The cluster's nodes listen on 127.0.0.1 only (kvbatch's driver follows a loopback --address by itself).
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

CLUSTER_PROCESS = """
import json, sys
from ray._private import ray_constants
ray_constants.ENABLE_RAY_CLUSTER = False
from ray.cluster_utils import Cluster

def describe(node):
    return {"node_id": node.node_id,
            "raylet_pid": node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid}

loopback = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
cluster = Cluster(initialize_head=True, head_node_args={**loopback, "num_cpus": 0})
workers = {}
for _ in range(int(sys.argv[1])):
    node = cluster.add_node(**loopback, num_cpus=1)
    workers[node.node_id] = node
print(json.dumps({"address": cluster.address, "nodes": [describe(n) for n in workers.values()]}), flush=True)
for line in sys.stdin:
    command, _, node_id = line.strip().partition(" ")
    if command == "remove":
        cluster.remove_node(workers.pop(node_id))
        print(json.dumps({"removed": node_id}), flush=True)
    elif command == "add":
        node = cluster.add_node(**loopback, num_cpus=1)
        workers[node.node_id] = node
        print(json.dumps({"added": describe(node)}), flush=True)
cluster.shutdown()
"""


class LocalCluster:
    """The child process holding the cluster; closing its stdin shuts every node down."""

    def __init__(self, tmp_dir: str) -> None:
        env = {**os.environ, **LOOPBACK, "RAY_TMPDIR": tmp_dir, "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            [sys.executable, "-c", CLUSTER_PROCESS, str(WORKER_NODES)], cwd=REPO, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        started = json.loads(self._reply())
        self.address: str = started["address"]
        self.node_of_raylet: dict[int, str] = {n["raylet_pid"]: n["node_id"] for n in started["nodes"]}

    def _reply(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the cluster process ended (exit {self.process.wait()}); see its stderr above")
        return line

    def node_of(self, worker: str) -> str:
        """The node id of a live worker named "host:pid"."""
        pid = int(worker.rpartition(":")[2])
        nodes = [self.node_of_raylet[p.pid] for p in psutil.Process(pid).parents() if p.pid in self.node_of_raylet]
        assert len(nodes) == 1, f"worker {worker} is not under exactly one worker node's raylet"
        return nodes[0]

    def remove_node(self, node_id: str) -> None:
        self.process.stdin.write(f"remove {node_id}\n")
        self.process.stdin.flush()
        assert json.loads(self._reply()) == {"removed": node_id}
        self.node_of_raylet = {pid: node for pid, node in self.node_of_raylet.items() if node != node_id}

    def add_node(self) -> str:
        """A new 1-CPU worker node (a lost node coming back joins as a new node); returns its id."""
        self.process.stdin.write("add\n")
        self.process.stdin.flush()
        added = json.loads(self._reply())["added"]
        self.node_of_raylet[added["raylet_pid"]] = added["node_id"]
        return added["node_id"]

    def shutdown(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[str]:
    # short: Ray's unix sockets live under it, and their paths are limited to ~107 characters
    with tempfile.TemporaryDirectory(prefix="kvb-ray-", dir="/tmp") as d:
        yield d


@pytest.fixture(scope="module")
def cluster(ray_tmp: str) -> Iterator[LocalCluster]:
    local = LocalCluster(ray_tmp)
    try:
        yield local
    finally:
        local.shutdown()


def manifest_of(tmp_path: Path) -> Path:
    return license_manifest(tmp_path, DOCS)


def summaries(job: Path) -> dict[str, str]:
    rows = export_rows(job)
    ids = [r["doc_id"] for r in rows]
    assert sorted(ids) == sorted(n.lower() for n in DOCS), f"not every document exactly once: {ids}"
    assert all(r["status"] == "done" for r in rows), rows
    return {r["doc_id"]: r["summary"] for r in rows}


def log_events(job: Path, event: str) -> list[dict]:
    path = job / "job.log"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == event]


def result_docs(job: Path) -> set[str]:
    """Documents of the result rows published so far (the job is still running)."""
    return {d for part in (job / "results").glob("part-*.parquet")
            for d in pq.read_table(part, columns=["doc_id"]).column("doc_id").to_pylist()}


def _hung_attempt(job: Path) -> list[dict]:
    """The `pass_assigned` lines of Apache-2.0's final pass (its summary's, which the fault hangs; a level
    `level_planned` calls `final`)."""
    final = {e["level"] for e in log_events(job, "level_planned") if e["doc_id"] == "apache-2.0" and e["final"]}
    return [e for e in log_events(job, "pass_assigned") if e["doc_id"] == "apache-2.0" and e["level"] in final]


@pytest.fixture(scope="module")
def single_node(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same batch on the session's single-node Ray, on one worker (results do not depend on how
    many workers ran them, nor on which node)."""
    tmp = tmp_path_factory.mktemp("single-node")
    kvbatch("submit", str(manifest_of(tmp)), "-c", str(TINY_CONFIG), "-j", str(tmp / "job"),
            "--address", ray_address, "--set", "workers.count=1", check=0)
    return summaries(tmp / "job")


@contextmanager
def submitted(manifest: Path, job: Path, address: str, *settings: str, env: dict | None = None
              ) -> Iterator[subprocess.Popen]:
    """`kvbatch submit` running in the background, killed if the block fails: a batch left running
    would hold the cluster's CPUs, and every later test here would wait for workers that never start."""
    proc = start_submit(manifest, job, address, *settings, env=env)
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        raise


def _lose_the_node_of_a_hung_task(cluster: LocalCluster, tmp_path: Path, *settings: str,
                                  while_pinned: Callable[[Path, subprocess.Popen], None] = lambda job, proc: None
                                  ) -> tuple[Path, set[str]]:
    """Runs the batch with a worker on every node (`auto`), calls `while_pinned` while one hangs on
    Apache-2.0, removes that worker's node, and returns the finished job and the nodes its workers were on."""
    job = tmp_path / "job"
    workers = len(cluster.node_of_raylet)
    hang = json.dumps([{"doc": "apache-2.0", "fault": "hang", "attempts": [1]}])
    with submitted(manifest_of(tmp_path), job, cluster.address, *settings, "--set", "batch.max_sequences=1",
                   "--set", "checkpoint.flush_every=1", env={"KVBATCH_FAULTS": hang}) as proc:
        # every other document is done, so the hang on Apache-2.0's own attempt is all that runs
        def only_the_hang_runs() -> bool:
            return result_docs(job) == {d.lower() for d in DOCS} - {"apache-2.0"} and bool(_hung_attempt(job))

        assert wait_for(only_the_hang_runs, proc, timeout=300), proc.communicate()
        ready = log_events(job, "worker_ready")
        assert len(ready) == workers
        nodes = {cluster.node_of(e["worker"]) for e in ready}  # while the workers live
        # the process of the slot that took the hung pass: not "the worker with no result", since any
        # worker runs any document's passes, and the one pinned may have published before
        [slot] = {e["worker"] for e in _hung_attempt(job)}
        [pinned] = [e["worker"] for e in ready if e["slot"] == slot]
        while_pinned(job, proc)
        cluster.remove_node(cluster.node_of(pinned))
        out, err = proc.communicate(timeout=120)  # well within the 300 s a lost worker is waited for
    assert proc.returncode == 0, out + err
    return job, nodes


def _check_lost_task_rerun_once(job: Path, single_node: dict[str, str]) -> None:
    assert summaries(job) == single_node
    rows = {r["doc_id"]: r for r in export_rows(job)}
    assert rows["apache-2.0"]["attempts"] == 2
    retries = log_events(job, "task_retry")
    assert [(e["doc_id"], e["error_type"]) for e in retries] == [("apache-2.0", "WorkerDied")], retries


def test_workers_land_on_every_node_and_a_lost_nodes_task_moves_to_another_worker(cluster, single_node, tmp_path):
    # a worker on every node: the lost worker cannot restart anywhere, so its task must move
    assert len(cluster.node_of_raylet) >= 2
    every_node = set(cluster.node_of_raylet.values())
    job, nodes = _lose_the_node_of_a_hung_task(cluster, tmp_path)
    assert nodes == every_node
    _check_lost_task_rerun_once(job, single_node)
    assert log_events(job, "batch_end")


ORPHAN_OWNER = """
import sys, time
from pathlib import Path
from storage.scratch import ensure_offload_root, task_scratch
root = ensure_offload_root(Path(sys.argv[1]))
with task_scratch(root, "earlier-job", "t000001", 1) as scratch:
    (scratch / "kv-block").write_bytes(b"x" * 4096)
    print(scratch, flush=True)
    time.sleep(600)
"""


def test_a_node_that_joins_mid_batch_is_swept_and_a_removed_node_loses_and_duplicates_nothing(
        cluster, single_node, tmp_path):
    root = tmp_path / "offload"

    def join_a_node(job: Path, proc: subprocess.Popen) -> None:
        """While Apache-2.0 hangs (the batch cannot end): a node joins and only its orphan dir is swept."""
        nodes_at_start = len(cluster.node_of_raylet) + 1  # the worker nodes, and the head
        assert wait_for(lambda: len(log_events(job, "node_swept")) >= nodes_at_start, proc, timeout=300), \
            proc.communicate()
        # a worker of an earlier batch, killed with its node: its task dir stays behind, owner dead
        owner = Child(ORPHAN_OWNER, str(root))
        orphan = Path(owner.read_line())
        owner.kill()
        assert orphan.is_dir()

        joined = cluster.add_node()
        assert wait_for(lambda: any(e["node_id"] == joined for e in log_events(job, "node_swept")), proc,
                        timeout=60), proc.communicate()
        swept = next(e for e in log_events(job, "node_swept") if e["node_id"] == joined)
        assert swept["dirs"] == [str(orphan)] and swept["bytes_freed"] >= 4096  # not the hung task's live dir
        assert not orphan.exists()

    # the joined node is the spare capacity where the removed node's worker is restarted
    job, _ = _lose_the_node_of_a_hung_task(cluster, tmp_path, "--set", f"cache.offload_root={root}",
                                           while_pinned=join_a_node)
    _check_lost_task_rerun_once(job, single_node)
