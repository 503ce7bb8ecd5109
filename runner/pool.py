"""The Ray worker pool: starts the worker actors, calls them, waits for a lost one to come back, kills them.

Everything the batch knows of Ray is here; the coordinator sees workers as opaque handles and losses as
`WorkerLost`. One lost process ends all of its `batch.max_sequences` calls: the pool counts the loss once
and says for each call whether batch-mates shared the process (then it is not its document's fault, yet).
A pass's `retry.task_timeout_s` runs from when it began to run in the worker, not while it waits there.
"""

from __future__ import annotations

import errno
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError

from jobs.config import ConfigError, JobConfig
from jobs.faults import FaultRule
from jobs.node_share import workers_per_node, workers_that_fit
from jobs.outcome import CallOutcome
from jobs.passes import PassSpec
from jobs.task import Task
from runner.cluster import kill_and_wait
from runner.observe.joblog import JobLog
from runner.worker_actor import WorkerActor

#: How long a restarted worker may take to come back (process start + model load), not task time.
WORKER_RESTART_TIMEOUT_S = 300.0
PROBE_GROUP = "probe"
"""The actor's concurrency group for `progress` and `tokens_decoded`: threads of their own (one for each
call in flight and one more), so a worker busy with its batch answers."""
PROBE_INTERVAL_S = 1.0
"""How often a call asks whether its pass has begun to run (at most a quarter of the timeout)."""
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
    """The worker died or hung: the call can run on any other worker while this one restarts.
    `shared`: other calls were in flight on it; `first_to_see`: this call is the one to report the loss;
    `event`: which loss (the slot and the incarnation lost), the same for every call it ended."""

    def __init__(self, error_type: str, message: str, shared: bool, first_to_see: bool,
                 event: tuple[str, int] | None = None) -> None:
        super().__init__(error_type, message)
        self.shared = shared
        self.first_to_see = first_to_see
        self.event = event


class _Hung(Exception):
    """The call ran past its time, or its worker stopped answering."""


class PoolStopped(Exception):
    """The pool was killed (the batch is stopping) while a call was in flight."""


#: The line of a traceback that names the exception: "package.module.Error: message" at column 0.
_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.*)$")


class WorkerStartError(ConfigError):
    """A worker's start raised: the job's settings (model, device, offload root) cannot run here, or
    `full_disk` names the offload root whose disk had no space for it (free space, no setting is wrong)."""

    def __init__(self, message: str, full_disk: Path | None = None) -> None:
        super().__init__(message)
        self.full_disk = full_disk


class WorkersNotStarted(Exception):
    """No worker was up within `workers.start_timeout_s`: the cluster has no room for one now."""


#: how an OSError's message starts when its disk or quota is full
_NO_SPACE = (f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]")


def _check_started(e: RayActorError, offload_root: Path) -> None:
    """Raises what a worker's start raised, on one line without Ray's frames (they come first); else
    the actor's process died after its start (ask the restarted one). Its only writes are under the
    offload root, so a full disk there is what an OSError for no space means."""
    if not (isinstance(e, ActorDiedError) and e.actor_init_failed):
        return
    lines = str(e).splitlines()
    raised = max((i for i, line in enumerate(lines) if _RAISED.match(line)), default=None)
    if raised is None:
        raise WorkerStartError(f"a worker could not start: {type(e).__name__}") from None
    kind, message = _RAISED.match(lines[raised]).groups()
    rest = " ".join(line.strip() for line in [message, *lines[raised + 1:]] if line.strip())
    full = kind.endswith("OSError") and message.startswith(_NO_SPACE)
    raise WorkerStartError(f"a worker could not start: {kind.rsplit('.', 1)[-1]}: {rest}",
                           offload_root if full else None) from None


def cluster_nodes() -> list[dict[str, float]]:
    """The CPUs and GPUs of each live node: a worker must fit on one node, not on the cluster's sum."""
    return [{"CPU": n["Resources"].get("CPU", 0.0), "GPU": n["Resources"].get("GPU", 0.0)}
            for n in ray.nodes() if n.get("Alive")]


def gpus_per_worker(config: JobConfig, nodes: list[dict[str, float]]) -> float:
    """`workers.gpus_per_worker`, or 0 on a cluster without GPUs (the workers run on CPUs)."""
    return config.workers.gpus_per_worker if any(n["GPU"] > 0 for n in nodes) else 0.0


def describe_cluster(nodes: list[dict[str, float]]) -> str:
    """e.g. "1 node: 2 CPUs, 0 GPUs"; the largest node too when there are several."""
    cpus, gpus = sum(n["CPU"] for n in nodes), sum(n["GPU"] for n in nodes)
    text = f"{len(nodes)} node(s): {cpus:g} CPUs, {gpus:g} GPUs"
    if len(nodes) > 1:
        text += f" (at most {max(n['CPU'] for n in nodes):g} CPUs and {max(n['GPU'] for n in nodes):g} GPUs on one)"
    return text


@dataclass(eq=False)
class _Call:
    """One call in flight on a slot. `shared` once another call was in flight beside it, at any moment
    (a batch-mate whose call has already ended when the loss reaches this one still shared the process)."""

    losses_before: int
    alone: bool
    shared: bool = False


@dataclass
class _Slot:
    """A worker's bookkeeping, changed under the pool's lock."""

    name: str
    process: str = ""  # the live incarnation's "host:pid"
    dead: set[str] = field(default_factory=set)  # incarnations known lost: their answers do not count
    calls: list[_Call] = field(default_factory=list)  # in flight
    losses: int = 0
    down: bool = False  # lost and not yet seen back: its feeding threads wait instead of calling it

    @property
    def exclusive(self) -> bool:
        """A task that must run alone holds the worker: no other call starts."""
        return any(call.alone for call in self.calls)

    def begin(self, alone: bool) -> _Call:
        call = _Call(self.losses, alone, shared=bool(self.calls))
        for other in self.calls:
            other.shared = True
        self.calls.append(call)
        return call

    def end(self, call: _Call) -> None:
        self.calls.remove(call)

    def lose(self, call: _Call, error_type: str, message: str) -> WorkerLost:
        """The loss as `call` sees it: counted once, by the first call to see it."""
        first_to_see = self.losses == call.losses_before
        if first_to_see:
            self.losses += 1
            self.down = True
            self.dead.add(self.process)
        return WorkerLost(error_type, message, call.shared, first_to_see, (self.name, call.losses_before))


class WorkerPool:
    def __init__(self, config: JobConfig, job_id: str, offload_root: Path, faults: list[FaultRule],
                 log: JobLog) -> None:
        self.cfg = config
        self.log = log  # job.log: where a lost worker is recorded, with what Ray said of it
        self.job_id = job_id
        self.offload_root = offload_root
        self.faults = faults
        self.workers: list[Worker] = []
        self._slots: dict[Worker, _Slot] = {}
        self._infos: dict[Worker, dict[str, Any]] = {}
        self._decoded: dict[str, int] = {}  # a worker process ("host:pid") -> tokens it decoded, last asked
        self._lock = threading.Condition()
        self._killed = False

    def worker_count(self, open_tasks: int) -> int:
        """`workers.count`, or with `auto` as many as the nodes hold; never more than the open tasks.
        Submit has refused a count the cluster cannot hold (runner/preflight.py `check_cluster`)."""
        if self.cfg.workers.count != "auto":
            wanted = self.cfg.workers.count
        else:
            nodes = cluster_nodes()
            wanted = workers_that_fit(nodes, self.cfg.workers.cpus_per_worker, gpus_per_worker(self.cfg, nodes))
        return max(1, min(wanted, open_tasks))

    def start(self, count: int, give_up: Callable[[], bool]) -> list[dict[str, Any]]:
        """Start `count` workers, wait until each has loaded its model and return their info; those up within
        `workers.start_timeout_s` run the batch (none: `WorkersNotStarted`). `WorkerStartError`: a worker's
        start raised (every worker would fail alike); `PoolStopped`: `give_up()` said so."""
        gpus = gpus_per_worker(self.cfg, cluster_nodes())
        # SPREAD: one worker per node before any node gets a second, so a lost node costs the fewest;
        # max_concurrency: each task in flight runs in an actor thread of its own
        remote_cls = ray.remote(concurrency_groups={PROBE_GROUP: self.cfg.batch.sequences + 1})(WorkerActor).options(
            num_cpus=self.cfg.workers.cpus_per_worker, num_gpus=gpus,
            max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD",
            max_concurrency=self.cfg.batch.sequences,
        )
        threads = max(1, int(self.cfg.workers.cpus_per_worker))
        node_workers = workers_per_node(count, cluster_nodes(), self.cfg.workers.cpus_per_worker, gpus)
        self.workers = [remote_cls.remote(self.cfg, self.job_id, self.offload_root, self.faults, threads, node_workers)
                        for _ in range(count)]
        try:
            infos = self._await_start(give_up, gpus)
        except BaseException:
            self.kill_all()
            raise
        self._slots = {w: _Slot(f"worker slot {i}", infos[w]["worker"]) for i, w in enumerate(self.workers)}
        self._infos = infos
        # the slot too: job.log names a slot where work is handed out, a process where it ran
        return [{**infos[w], "slot": self._slots[w].name} for w in self.workers]

    def _await_start(self, give_up: Callable[[], bool], gpus: float) -> dict[Worker, dict[str, Any]]:
        """Each worker's info once it is up; polled, so a signal or the deadline ends the wait."""
        timeout_s = self.cfg.workers.start_timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = {w.info.remote(): w for w in self.workers}
        infos: dict[Worker, dict[str, Any]] = {}
        while waiting:
            if give_up():
                raise PoolStopped()
            if time.monotonic() >= deadline:
                break
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=0.5)
            for ref in ready:
                worker = waiting.pop(ref)
                try:
                    infos[worker] = ray.get(ref)
                except RayActorError as e:
                    _check_started(e, self.offload_root)
                    waiting[worker.info.remote()] = worker
        if not infos:
            raise WorkersNotStarted(
                f"no worker started within workers.start_timeout_s={timeout_s:g} s: Ray could not place a "
                f"worker of {self.cfg.workers.cpus_per_worker:g} CPU(s) and {gpus:g} GPU(s) on "
                f"{describe_cluster(cluster_nodes())}, so other work holds them"
            )
        if waiting:  # the batch goes on with those that are up
            kill_and_wait(list(waiting.values()))
            self.workers = [w for w in self.workers if w in infos]
        return infos

    def slot_name(self, worker: Worker) -> str:
        return self._slots[worker].name

    def is_down(self, worker: Worker) -> bool:
        """Lost and not yet back: a call now would reach the dying process, or wait for the new one."""
        return self._slots[worker].down

    def tokens_decoded(self) -> int:
        """Tokens the workers have decoded while this pool ran them, every incarnation counted; a worker
        that does not answer within a second is left at its last answer."""
        refs = {self._slots[w].process: w.tokens_decoded.options(concurrency_group=PROBE_GROUP).remote()
                for w in self.workers if not self.is_down(w)}
        for process, ref in refs.items():
            try:
                self._decoded[process] = max(self._decoded.get(process, 0), ray.get(ref, timeout=1.0))
            except RayError:  # a timeout, a worker lost meanwhile
                continue
        return sum(self._decoded.values())

    def info(self, worker: Worker) -> dict[str, Any]:
        """What the worker said of itself when it started (its model, its quantization)."""
        return self._infos[worker]

    def plan(self, worker: Worker, task: Task, context_tokens: int, alone: bool) -> CallOutcome:
        """The document's first level, planned by the worker (its outcome's `plan`)."""
        return self._call(worker, alone, lambda call_id: worker.plan.remote(task, context_tokens))

    def plan_merge(self, worker: Worker, task: Task, level: int, texts: list[str], context_tokens: int,
                   alone: bool) -> CallOutcome:
        """Level `level` of the document, planned from the summaries `texts` of the level before."""
        return self._call(worker, alone, lambda call_id: worker.plan_merge.remote(task, level, texts, context_tokens))

    def run_pass(self, worker: Worker, spec: PassSpec, attempt: int, alone: bool) -> CallOutcome:
        """One pass run on the worker's cache ladder (its outcome's `row` when it finished)."""
        return self._call(worker, alone, lambda call_id: worker.run_pass.remote(spec, attempt, call_id))

    def _call(self, worker: Worker, alone: bool, send: Callable[[str], Any]) -> CallOutcome:
        """The outcome of the call `send` makes (given its call id). Raises `WorkerLost` when the worker's
        process died or hung. `alone`: wait until nothing else runs on the worker and keep it so, so
        that a loss now is this call's document's own."""
        slot = self._slots[worker]
        while True:
            # a call must reach a live incarnation: one sent while Ray restarts the worker fails at once
            if slot.down and not self.await_restart(worker, lambda: self._killed):
                raise WorkerLost("WorkerDied", f"{slot.name} did not come back within {WORKER_RESTART_TIMEOUT_S:.0f} s",
                                 shared=True, first_to_see=False)
            with self._lock:
                while slot.exclusive or (alone and slot.calls):
                    if self._killed:
                        raise PoolStopped()
                    self._lock.wait(0.2)
                if slot.down:  # lost while this call waited for its turn: wait for the restart again
                    continue
                call = slot.begin(alone)
                break
        call_id = uuid.uuid4().hex
        try:
            return self._result(worker, send(call_id), call_id)
        except _Hung as e:
            ray.kill(worker, no_restart=False)  # a hung worker is restarted, with a fresh model
            raise self._lost(slot, call, "TimeoutError", str(e)) from None
        except RayActorError as e:
            if self._killed:
                raise PoolStopped() from None
            raise self._lost(slot, call, "WorkerDied", f"worker process died: {e}") from None
        finally:
            with self._lock:
                slot.end(call)
                self._lock.notify_all()

    def _result(self, worker: Worker, ref: Any, call_id: str) -> CallOutcome:
        """The call's outcome, or `_Hung` past retry.task_timeout_s from when it began to run (the worker's
        `progress` says when), or past task_timeout_s × batch.max_sequences before it began (behind at most
        max_sequences - 1 batch-mates, each within its timeout), or when the worker does not answer."""
        limit = self.cfg.retry.task_timeout_s
        wait_limit = limit * self.cfg.batch.sequences
        sent = time.monotonic()
        running_s: float | None = None
        while True:
            wait_s = min(PROBE_INTERVAL_S, limit / 4)
            if running_s is not None:
                if running_s >= limit:
                    raise _Hung(f"no result within retry.task_timeout_s={limit:g}s of its first sequence starting")
                wait_s = min(wait_s, limit - running_s)
            ready, _ = ray.wait([ref], timeout=wait_s)
            if ready:
                return ray.get(ref)
            probe = worker.progress.options(concurrency_group=PROBE_GROUP).remote(call_id)
            try:
                now_running_s = ray.get(probe, timeout=PROBE_TIMEOUT_S)
            except GetTimeoutError:
                raise _Hung(f"the worker did not answer within {PROBE_TIMEOUT_S:g}s how the pass was doing: "
                            "it is hung") from None
            running_s = now_running_s if now_running_s is not None else running_s
            if running_s is None and time.monotonic() - sent > wait_limit:
                raise _Hung(f"not begun within {wait_limit:g}s of being sent (retry.task_timeout_s × "
                            "batch.max_sequences): the worker is stuck")

    def _lost(self, slot: _Slot, call: _Call, error_type: str, message: str) -> WorkerLost:
        """The loss as `call` sees it; the first call to see it records it in job.log (`worker_lost`: the
        slot, the process lost, the cause Ray gave), once however many calls it ended."""
        with self._lock:
            process = slot.process
            lost = slot.lose(call, error_type, message)
        if lost.first_to_see:
            self.log.warning("worker_lost", worker=slot.name, process=process, error_type=error_type,
                             cause=" ".join(message.split()))
        return lost

    def await_restart(self, worker: Worker, give_up: Any) -> bool:
        """Wait until Ray has restarted a killed or crashed worker: its next task must reach the new
        incarnation, not the dying one (a hung worker's other threads answer until `ray.kill` lands). False
        when it did not come back in time, or `give_up()`; `WorkerStartError` when its start raised."""
        slot = self._slots[worker]
        deadline = time.monotonic() + WORKER_RESTART_TIMEOUT_S
        ready = worker.info.remote()
        while not give_up():
            if time.monotonic() >= deadline:
                return False
            try:
                process = ray.get(ready, timeout=1.0)["worker"]
            except RayActorError as e:  # it reached the dying incarnation: ask the next one
                _check_started(e, self.offload_root)
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

    def kill_down(self) -> list[str]:
        """Kills the workers that are down (lost, not yet back) for good; like `kill_all`, returns once
        their processes are gone, naming any still alive."""
        return kill_and_wait([w for w in self.workers if self._slots[w].down])

    def kill_all(self) -> list[str]:
        """Ends every pending call at once (they raise `PoolStopped`) and returns once the workers'
        processes are gone, naming any still alive after the wait."""
        self._killed = True
        return kill_and_wait(self.workers)
