"""The Ray worker pool: starts the worker actors, calls them, waits for a lost one to come back, kills them.

Everything the batch knows of Ray is here; the coordinator sees workers as opaque handles, outcomes
as dicts and losses as `WorkerLost`. Each actor takes `batch.max_sequences` calls at once (one
thread a task, its sequences batched by the worker's scheduler), so one lost process ends several
tasks: the pool counts that loss once, and says for each of its tasks whether batch-mates shared
the process (then the loss is not the task's own fault, yet). A task suspected of crashing its
batches runs `alone`: it waits for its worker to be idle and keeps it to itself. A call's
`retry.task_timeout_s` runs from when its task began to run in the worker, not while it waits
there behind its batch-mates (`_result`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from jobs.config import JobConfig
from jobs.faults import FaultRule
from jobs.node_share import workers_per_node
from jobs.outcome import TaskOutcome
from jobs.task import Task
from runner.cluster import kill_and_wait
from runner.engine.worker import SummaryWorker

#: How long a restarted worker may take to come back (process start + model load), not task time.
WORKER_RESTART_TIMEOUT_S = 300.0
PROBE_GROUP = "probe"
"""The actor's concurrency group for `running_s`: its own thread, so a worker busy with its batch answers."""
PROBE_INTERVAL_S = 5.0
"""How often a call whose task has not begun to run asks whether it has (at most a quarter of the timeout)."""
PROBE_TIMEOUT_S = 60.0
"""A worker that does not answer that question within this is hung (a short task timeout does not
shorten it: a loaded node may answer slowly)."""

Worker = Any
"""An actor handle; the coordinator only passes it back to the pool."""


class TransientFailure(Exception):
    """A failure worth retrying with the same settings."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class WorkerLost(TransientFailure):
    """The worker died or hung: the task can run on any other worker while this one restarts.
    `shared`: other tasks were in flight on it; `first_to_see`: this task is the one to report the loss."""

    def __init__(self, error_type: str, message: str, shared: bool, first_to_see: bool) -> None:
        super().__init__(error_type, message)
        self.shared = shared
        self.first_to_see = first_to_see


class _Hung(Exception):
    """The call ran past its time, or its worker stopped answering."""


class PoolStopped(Exception):
    """The pool was killed (the batch is stopping) while a call was in flight."""


@dataclass
class _Slot:
    name: str
    process: str = ""  # the live incarnation's "host:pid"
    dead: set[str] = field(default_factory=set)  # incarnations known lost: their answers do not count
    in_flight: int = 0
    losses: int = 0
    down: bool = False  # lost and not yet seen back: its feeding threads wait instead of calling it
    exclusive: bool = False  # a task that must run alone holds the worker: no other call starts


def _alive_nodes() -> list[dict[str, float]]:
    """Each live node's resources, for how many workers will share one (their `auto` budgets split)."""
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


class WorkerPool:
    def __init__(self, config: JobConfig, job_id: str, offload_root: Path, faults: list[FaultRule]) -> None:
        self.cfg = config
        self.job_id = job_id
        self.offload_root = offload_root
        self.faults = faults
        self.workers: list[Worker] = []
        self._slots: dict[Worker, _Slot] = {}
        self._lock = threading.Condition()
        self._killed = False

    def worker_count(self, open_tasks: int) -> int:
        if self.cfg.workers.count != "auto":
            wanted = self.cfg.workers.count
        else:
            resources = ray.cluster_resources()
            if resources.get("GPU", 0) > 0 and self.cfg.workers.gpus_per_worker > 0:
                wanted = int(resources["GPU"] // self.cfg.workers.gpus_per_worker)
            else:
                wanted = int(resources.get("CPU", 1) // self.cfg.workers.cpus_per_worker)
        return max(1, min(wanted, open_tasks))

    def start(self, count: int) -> list[dict[str, Any]]:
        """Start `count` workers and wait until each has loaded its model; returns their info."""
        resources = ray.cluster_resources()
        gpus = self.cfg.workers.gpus_per_worker if resources.get("GPU", 0) > 0 else 0
        # SPREAD: one worker per node before any node gets a second, so a lost node costs the fewest;
        # max_concurrency: each task in flight runs in an actor thread of its own
        remote_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(SummaryWorker).options(
            num_cpus=self.cfg.workers.cpus_per_worker, num_gpus=gpus,
            max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD",
            max_concurrency=self.cfg.batch.sequences,
        )
        threads = max(1, int(self.cfg.workers.cpus_per_worker))
        config = self.cfg.model_dump(mode="json")
        faults = [f.model_dump() for f in self.faults]
        node_workers = workers_per_node(count, _alive_nodes(), self.cfg.workers.cpus_per_worker, gpus)
        self.workers = [remote_cls.remote(config, self.job_id, str(self.offload_root), faults, threads, node_workers)
                        for _ in range(count)]
        infos = ray.get([w.info.remote() for w in self.workers])
        self._slots = {w: _Slot(f"worker slot {i}", info["worker"]) for i, (w, info) in enumerate(zip(self.workers, infos))}
        return infos

    def slot_name(self, worker: Worker) -> str:
        return self._slots[worker].name

    def is_down(self, worker: Worker) -> bool:
        """Lost and not yet back: a call now would reach the dying process, or wait for the new one."""
        return self._slots[worker].down

    def run(self, worker: Worker, task: Task, attempt: int, context_tokens: int, alone: bool) -> TaskOutcome:
        """The worker's outcome for one attempt; raises `WorkerLost` when its process died or hung.
        `alone`: wait until nothing else runs on the worker and keep it so, so that a loss now is
        this task's own."""
        slot = self._slots[worker]
        # a call must reach a live incarnation: one sent while Ray restarts the worker fails at once
        if slot.down and not self.await_restart(worker, lambda: self._killed):
            raise WorkerLost("WorkerDied", f"{slot.name} did not come back within {WORKER_RESTART_TIMEOUT_S:.0f} s",
                             shared=True, first_to_see=False)
        with self._lock:
            while slot.exclusive or (alone and slot.in_flight > 0):
                if self._killed:
                    raise PoolStopped()
                self._lock.wait(0.2)
            slot.in_flight += 1
            slot.exclusive = alone
            shared = slot.in_flight > 1
            losses_before = slot.losses
        call_id = uuid.uuid4().hex
        ref = worker.run.remote(dataclasses.asdict(task), attempt, context_tokens, call_id)
        try:
            return self._result(worker, ref, call_id)
        except _Hung as e:
            ray.kill(worker, no_restart=False)  # a hung worker is restarted, with a fresh model
            raise self._lost(slot, losses_before, shared, "TimeoutError", str(e)) from None
        except RayActorError as e:
            if self._killed:
                raise PoolStopped() from None
            raise self._lost(slot, losses_before, shared, "WorkerDied", f"worker process died: {e}") from None
        finally:
            with self._lock:
                slot.in_flight -= 1
                slot.exclusive = slot.exclusive and not alone
                self._lock.notify_all()

    def _result(self, worker: Worker, ref: Any, call_id: str) -> TaskOutcome:
        """The call's outcome. Its retry.task_timeout_s runs from when the task's first sequence began
        to run in the worker (the worker says when), not from when the call was sent. Waiting before
        that has a limit of its own: behind at most batch.max_sequences - 1 batch-mates, each within
        its timeout, it begins within task_timeout_s × batch.max_sequences, or the worker is stuck.
        Raises `_Hung` past either, or when the worker does not answer whether the task has begun."""
        limit = self.cfg.retry.task_timeout_s
        wait_limit = limit * self.cfg.batch.sequences
        sent = time.monotonic()
        while True:
            try:
                return ray.get(ref, timeout=min(PROBE_INTERVAL_S, limit / 4))
            except GetTimeoutError:
                pass
            probe = worker.running_s.options(concurrency_group=PROBE_GROUP).remote(call_id)
            try:
                running_s = ray.get(probe, timeout=PROBE_TIMEOUT_S)
            except GetTimeoutError:
                raise _Hung(f"the worker did not answer within {PROBE_TIMEOUT_S:g}s whether the task had begun: "
                            "it is hung") from None
            if running_s is not None:
                break
            if time.monotonic() - sent > wait_limit:
                raise _Hung(f"not begun within {wait_limit:g}s of being sent (retry.task_timeout_s × "
                            "batch.max_sequences): the worker is stuck")
        try:
            return ray.get(ref, timeout=max(0.0, limit - running_s))
        except GetTimeoutError:
            raise _Hung(f"no result within retry.task_timeout_s={limit:g}s of its first sequence starting") from None

    def _lost(self, slot: _Slot, losses_before: int, shared: bool, error_type: str, message: str) -> WorkerLost:
        with self._lock:
            first_to_see = slot.losses == losses_before
            if first_to_see:
                slot.losses += 1
                slot.down = True
                slot.dead.add(slot.process)
            shared = shared or slot.in_flight > 1
        return WorkerLost(error_type, message, shared, first_to_see)

    def await_restart(self, worker: Worker, give_up: Any) -> bool:
        """Wait until Ray has restarted a killed or crashed worker (its start sweeps the scratch dir the
        dead process left; its next task must reach it, not the dying incarnation, which a hung
        worker's other threads still answer from until `ray.kill` lands). False when it did not come
        back in time (no capacity left for it), or `give_up()` says the batch needs it no more."""
        slot = self._slots[worker]
        deadline = time.monotonic() + WORKER_RESTART_TIMEOUT_S
        ready = worker.info.remote()
        while not give_up():
            if time.monotonic() >= deadline:
                return False
            try:
                process = ray.get(ready, timeout=1.0)["worker"]
            except RayActorError:  # it reached the dying incarnation: ask the next one
                process = None
            except GetTimeoutError:
                continue
            with self._lock:
                if process is not None and process not in slot.dead:
                    slot.process, slot.down = process, False
                    return True
            time.sleep(0.1)
            ready = worker.info.remote()
        return False

    def kill_all(self) -> list[str]:
        """Ends every pending call at once (they raise `PoolStopped`) and returns once the workers'
        processes are gone, naming any still alive after the wait."""
        self._killed = True
        return kill_and_wait(self.workers)
