"""The coordinator's Ray worker pool (runner/pool.py) on a real local Ray: it tells each worker how many
share its node, and `kill_all` returns only once the killed workers' processes are gone.

(Starting workers through the CLI, with its errors and timeouts: tests/test_worker_start.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jobs.config import load_config
from runner.observe.joblog import JobLog
from runner.pool import WorkerPool
from storage.scratch import ROOT_MARKER, sweep_orphans
from tests.helpers.cli import TINY_CONFIG, kvbatch, write_jsonl
from tests.helpers.system import half_available_ram


def test_the_pool_tells_each_worker_how_many_share_its_node(ray_address, tmp_path: Path) -> None:
    """Two workers on the one node of the test's Ray: each knows it shares the node with the other
    and sizes its `auto` host budget as half of what one worker alone would take."""
    config = load_config(TINY_CONFIG, ["workers.count=2", "workers.cpus_per_worker=1"])
    pool = WorkerPool(config, "job", tmp_path / "kv", [], JobLog(tmp_path / "job.log"))
    try:
        infos = pool.start(2, give_up=lambda: False)
    finally:
        pool.kill_all()
    assert [info["node_workers"] for info in infos] == [2, 2]
    alone = half_available_ram()
    assert all(info["host_kv_budget_bytes"] <= alone / 2 * 1.1 for info in infos), (infos, alone)


def test_the_interrupted_batch_waits_for_its_killed_workers_before_the_last_sweep(ray_address, tmp_path):
    """The moment that matters, without Ray's task-scheduling latency to hide it: right after the
    coordinator abandons its workers, a sweep must find their processes gone and their dirs orphans."""
    import ray


    class Holder:
        """A real worker process in the middle of a task: its scratch dir is open."""

        def hold(self, root: str, task_id: str) -> tuple[str, int]:
            from storage.scratch import task_scratch

            self.scratch = task_scratch(Path(root), "job", task_id, 1)
            folder = self.scratch.__enter__()
            (folder / "block-0.kvblocks").write_bytes(b"k" * 100000)
            return str(folder), os.getpid()

    root = tmp_path / "kv"
    pool = WorkerPool(load_config(TINY_CONFIG), "job", root, [], JobLog(tmp_path / "job.log"))
    actors = [ray.remote(num_cpus=0)(Holder).remote() for _ in range(2)]
    held = ray.get([a.hold.remote(str(root), f"t00000{i}") for i, a in enumerate(actors)])
    assert all(Path(folder).is_dir() for folder, _ in held)

    pool.workers = actors
    assert pool.kill_all() == []
    swept = sweep_orphans(root)

    assert sorted(str(s.path) for s in swept) == sorted(folder for folder, _ in held), [s.reason for s in swept]
    assert sorted(p.name for p in root.iterdir()) == [ROOT_MARKER]


def test_a_call_waiting_to_run_alone_reaches_the_worker_that_replaces_the_one_lost_before_it(ray_address, tmp_path):
    """Two passes that must run alone on one worker: the first hangs and its worker is killed and
    restarted. The second, which waited behind it, runs on the new process; it is not sent to the
    restarting one, whose loss would be charged to it (a batch-mate of a crashing document failed so)."""
    import threading
    import time

    from jobs.documents import text_sha256
    from jobs.faults import FaultRule
    from jobs.task import Task
    from runner.pool import WorkerLost

    def task(doc_id: str) -> Task:
        text = "A short memo about the license of this package. " * 4
        return Task(f"t-{doc_id}", doc_id, "text", text, len(text), len(text), text_sha256(text), {}, {})

    config = load_config(TINY_CONFIG, ["workers.count=1", "retry.task_timeout_s=6"])
    pool = WorkerPool(config, "job", tmp_path / "kv", [FaultRule(doc="hangs", fault="hang")],
                      JobLog(tmp_path / "job.log"))
    try:
        [info] = pool.start(1, give_up=lambda: False)
        worker = pool.workers[0]
        ended: dict[str, float] = {}
        [hangs], [waits] = (pool.plan(worker, task(doc_id), 1024, alone=False)["plan"].specs
                            for doc_id in ("hangs", "waits"))

        def hanging() -> None:
            try:
                pool.run_pass(worker, hangs, 1, alone=True)
            except WorkerLost:
                ended["hangs"] = time.monotonic()

        first = threading.Thread(target=hanging)
        first.start()
        time.sleep(2.0)  # the first call is in the worker, hanging: the second must wait for it
        assert first.is_alive()
        sent = time.monotonic()
        outcome = pool.run_pass(worker, waits, 1, alone=True)
        first.join()
    finally:
        pool.kill_all()
    assert sent < ended["hangs"], "the second call did not wait behind the first: nothing was tested"
    assert outcome["status"] == "done", outcome
    assert outcome["worker"] != info["worker"], "it ran on the process that hung"


def test_a_batch_mate_whose_call_ended_first_still_shared_the_loss() -> None:
    """The first call ran alone in flight until a batch-mate joined; the process dies, the batch-mate
    sees the loss first and its call ends before the first call sees it. The first call's loss is
    still shared: counting only the calls in flight at its start and at its loss charged it to the
    first call, and a batch-mate of a crashing document ran out of attempts (test_batching_e2e)."""
    from runner.pool import _Slot

    slot = _Slot("worker slot 0", "host:1")
    first = slot.begin(alone=False)
    mate = slot.begin(alone=False)
    mates_loss = slot.lose(mate, "WorkerDied", "worker process died")
    slot.end(mate)
    firsts_loss = slot.lose(first, "WorkerDied", "worker process died")
    slot.end(first)
    assert mates_loss.first_to_see and not firsts_loss.first_to_see and slot.losses == 1
    assert mates_loss.shared and firsts_loss.shared
    alone = slot.begin(alone=True)
    assert slot.exclusive and not slot.lose(alone, "WorkerDied", "worker process died").shared
    slot.end(alone)
    assert not slot.exclusive and slot.calls == []


def test_a_worker_that_dies_is_a_worker_lost_event_in_job_log_and_no_ray_line_in_the_output(ray_address, tmp_path):
    """A worker process that exits mid-task (a real exit): Ray's driver printed "(raylet) A worker died ..."
    into submit's output, and job.log had no event for the loss, only the retries it caused."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "The board met on Monday and approved it."},
                                                  {"id": "b", "text": "The committee reviewed the figures."}])
    job = tmp_path / "job"
    proc = kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
                   "--set", "workers.count=1", env={"KVBATCH_FAULTS": json.dumps([{"doc": "a", "fault": "crash",
                                                                                  "attempts": [1]}])}, check=0)
    events = [json.loads(line) for line in (job / "job.log").read_text().splitlines()]
    names = [e["event"] for e in events]
    [ready] = [e for e in events if e["event"] == "worker_ready"]
    [lost] = [e for e in events if e["event"] == "worker_lost"]
    assert names.index("worker_lost") < names.index("task_retry"), names  # the loss, then what it cost
    assert lost["worker"] == ready["slot"] and lost["process"] == ready["worker"], (lost, ready)
    assert lost["error_type"] == "WorkerDied" and "actor" in lost["cause"], lost  # what Ray said of it
    output = proc.stdout + proc.stderr
    assert "A worker died" not in output and "(raylet)" not in output, output
