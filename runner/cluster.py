"""Joining or starting Ray (a local instance binds to localhost only, without the dashboard), stopping
actors for good, and sweeping the scratch dirs of the nodes a batch runs on (`NodeSweeper`)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants
from ray._private import state as ray_state
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jobs.config import ConfigError
from runner.observe.joblog import JobLog
from storage.scratch import sweep_orphans


def _keep_loopback() -> None:
    """Make Ray keep 127.0.0.1 as this node's address: else it turns it into the host's routable IP and its
    gRPC servers listen on every interface. The constant is read when a node starts (this process); the
    environment variable reaches the processes Ray spawns."""
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _host_port(address: str) -> tuple[str, str]:
    """("host", "port") of "[scheme://]host:port"; port "" when the address has none ("auto")."""
    host, _, port = address.split("://")[-1].rpartition(":")
    return host.strip("[]"), port


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class RayStartError(ConfigError):
    """A private local Ray could not start here (nothing was created)."""


def init_local_ray(**options: object) -> None:
    """Start a private local Ray that listens on loopback only, without the dashboard. `address="local"`:
    never the cluster a `ray_current_cluster` file names, which ray.init joins otherwise (someone else's,
    or a stale file's, where ray.init retries "Failed to connect to GCS" for good)."""
    _keep_loopback()
    try:
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **options)
    except Exception as e:  # noqa: BLE001 - whatever Ray raised, the user gets one line
        ray.shutdown()  # what started of it goes with it
        raise RayStartError(
            f"a private local Ray could not start here ({type(e).__name__}: {_first_line(e)}): check that "
            "$RAY_TMPDIR (else /tmp) is a writable folder with free space, or join a running cluster with --address"
        ) from None
    _start_reaper()


#: Kills the listed processes ("pid:start time") once its stdin reaches EOF: when the driver exits or is killed.
_REAPER = """
import signal, sys
import psutil
signal.signal(signal.SIGINT, signal.SIG_IGN)
family = [arg.split(":") for arg in sys.argv[1:]]
sys.stdin.buffer.read()
for pid, started in family:
    try:
        process = psutil.Process(int(pid))
        if abs(process.create_time() - float(started)) < 0.01:
            process.kill()
    except psutil.Error:
        pass
"""


def _start_reaper() -> None:
    """The private Ray's processes die with this driver, whatever ends it (docs/cluster.md).

    After a `kill -9` of the driver the raylet's agents would wait out a 60 s call to the dead GCS,
    orphaned. A small process kills what this Ray started (never another child of the caller's) once the
    pipe from the driver closes; process start times guard against reused pids.
    """
    import psutil
    from ray._private import worker as ray_worker

    # the processes its node lists, with every child they have started so far (the raylet's agents and workers)
    processes = []
    for _, popen in ray_worker._global_node.live_processes():
        try:
            process = psutil.Process(popen.pid)
            processes += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    family = [f"{p.pid}:{p.create_time()}" for p in processes]
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, *family], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _reapers.append(reaper)


#: The reapers of this process's private Rays: each one's stdin closes with the process, or after ray.shutdown().
_reapers: list[subprocess.Popen[bytes]] = []


def _reap() -> None:
    """After ray.shutdown(): whatever of the private Ray is still there goes now, not when this process exits."""
    while _reapers:
        reaper = _reapers.pop()
        reaper.stdin.close()
        reaper.wait()


#: How long a connection to a given address may take before no cluster counts as being there.
CONNECT_TIMEOUT_S = 5.0


_ADDRESS_FIX = ("check --address or $RAY_ADDRESS, start one there with `ray start --head`, or leave --address out "
                "to run on a private local Ray")
#: Ray sends its token to an address given explicitly only when told to; a token cluster refuses it otherwise.
_AUTH_FIX = ("a cluster with token authentication (`ray start`'s default) takes only drivers that send its token: "
             "set RAY_AUTH_MODE=token (the token read from ~/.ray/auth_token or $RAY_AUTH_TOKEN) and run again; "
             "else " + _ADDRESS_FIX)


class ClusterUnreachableError(ConfigError):
    """The address given names a place where no Ray cluster answers (nothing was started or written)."""

    def __init__(self, address: str, why: str, fix: str = _ADDRESS_FIX) -> None:
        super().__init__(f"no Ray cluster answers at {address} ({why}): {fix}")


def _check_reachable(address: str) -> None:
    """ray.init retries an address where nothing listens for good: one TCP connect says so in seconds."""
    host, port = _host_port(address)
    if not port.isdigit():
        return  # "auto" and the like: Ray looks for a cluster on this machine itself (ConnectionError if none)
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterUnreachableError(address, e.strerror or str(e) or type(e).__name__) from None


#: Where the errors a Ray cluster reports to this driver go instead of stdout.
_RAY_ERRORS = logging.getLogger("ray.reported_errors")


def _quiet_ray_errors() -> None:
    """Ray's driver prints every error its cluster reports ("(raylet) A worker died ...") to stdout,
    whatever `log_to_driver` says, into the user's progress and results. kvbatch reports what it meets
    itself (job.log's `worker_lost`, with the cause Ray gives the call): those lines go to a debug logger.
    With `log_to_driver` off, the error listener is the only caller of what is replaced."""
    from ray._private import worker as ray_worker

    ray_worker.print_to_stdstream = lambda data, ignore_prefix: _RAY_ERRORS.debug(" ".join(data["lines"]))


@contextmanager
def ray_session(address: str | None) -> Iterator[dict[str, float]]:
    """Connects to `address` (or $RAY_ADDRESS), else starts a private local instance; yields its resources.
    Inside a session this process holds already (submit asks the cluster before it creates the job
    folder), that one is used, and left to its owner to end."""
    if ray.is_initialized():
        yield ray.cluster_resources()
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    # token authentication stays on (it is the safe default); only its notice is silenced
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    options = {"logging_level": logging.WARNING, "log_to_driver": False}
    _quiet_ray_errors()
    if address:
        _join(address, options)
    else:
        init_local_ray(**options)
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()
        _reap()


def _join(address: str, options: dict[str, Any]) -> None:
    _check_reachable(address)
    if _host_port(address)[0] in ("127.0.0.1", "localhost", "::1"):
        # a loopback-only cluster: this driver must see itself at 127.0.0.1 too, or it never finds a raylet
        _keep_loopback()
        options = {**options, "_node_ip_address": "127.0.0.1"}
    try:
        ray.init(address=address, **options)
    except ConnectionError as e:  # something listens there, but no Ray cluster this driver can join
        explicit = address != "auto"  # Ray sends the token to a cluster it finds itself
        fix = _AUTH_FIX if explicit and os.environ.get("RAY_AUTH_MODE") is None else _ADDRESS_FIX
        raise ClusterUnreachableError(address, _first_line(e), fix) from None
    except Exception as e:  # noqa: BLE001 - a version mismatch, a timeout: one line, whatever Ray raised
        ray.shutdown()
        raise ClusterUnreachableError(address, f"{type(e).__name__}: {_first_line(e)}") from None


#: How long a killed worker may take to exit (a CUDA context can take seconds to tear down).
ACTOR_EXIT_TIMEOUT_S = 60.0


def _actor_process(actor: Any) -> tuple[str, int] | None:
    """(node id, pid) of the actor's current process, from the GCS actor table; None when unknown."""
    info = ray_state.actors(actor_id=actor._actor_id.hex())
    if not info or not info.get("Pid") or info.get("State") == "DEAD":
        return None
    return info["Address"]["NodeID"], int(info["Pid"])


def _wait_for_exit(pids: list[int], timeout_s: float) -> list[int]:
    """On the node where it runs: wait until these processes are gone; returns those still alive."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def kill_and_wait(actors: list[Any], timeout_s: float = ACTOR_EXIT_TIMEOUT_S) -> list[str]:
    """Kill the actors for good and return once their processes have exited (`ray.kill` only asks): a killed
    worker's scratch dir is an orphan, swept, only then. Returns "pid P on node N" for each still alive."""
    processes = [_actor_process(actor) for actor in actors]
    for actor in actors:
        ray.kill(actor, no_restart=True)
    by_node: dict[str, list[int]] = {}
    for node_pid in filter(None, processes):
        by_node.setdefault(node_pid[0], []).append(node_pid[1])
    waiter = ray.remote(num_cpus=0, max_retries=0)(_wait_for_exit)
    pending = {
        node: waiter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pids, timeout_s)
        for node, pids in by_node.items()
    }
    left = []
    for node, ref in pending.items():
        try:
            left += [f"pid {pid} on node {node}" for pid in ray.get(ref, timeout=timeout_s + 30)]
        except Exception as e:  # a node lost meanwhile took its processes with it
            left += [f"pids {by_node[node]} on node {node} (not checked: {type(e).__name__})"]
    return left


# -- sweeping the nodes a batch runs on -----------------------------------------------------------
# A node back from a crash still holds the task dirs of the workers it lost, and nothing else removes them.
# Every node is swept at the batch's start, on joining and at its end (a worker lost late may never sweep
# its own dir), by a zero-CPU Ray task pinned to the node, so it runs even where workers take every CPU.

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

    def __init__(self, offload_root: Path, log: JobLog) -> None:
        self.offload_root = str(offload_root)
        self.log = log
        self._swept: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="node-sweeper", daemon=True)
        self._remote = ray.remote(num_cpus=0, max_retries=0)(_sweep_here)

    def _sweep(self, new_only: bool) -> None:
        """Sweep the live nodes (`new_only`: those not swept yet); a failure is logged, not retried:
        the sweeper must never take the batch down."""
        try:
            pending = {
                node_id: self._remote.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(self.offload_root)
                for node_id in _alive_nodes() - (self._swept if new_only else set())
            }
        except Exception as e:
            self.log.warning("node_sweep_failed", error=f"{type(e).__name__}: {e}")
            return
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
            self._sweep(new_only=True)
            if self._stop.wait(POLL_S):
                return

    def __enter__(self) -> NodeSweeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=70)
        self._sweep(new_only=False)
