"""The job's lease on object storage (storage/lease.py): one coordinator at a time, taken over only after
a full TTL without a change on the taker's own clock, and a holder that lost it writes nothing more."""

from __future__ import annotations

import json
import threading
import time

import pytest

from storage.checkpoint import CheckpointLog, compact, load_state
from storage.lease import JobLease, LeaseLostError, job_lock
from storage.location import Location
from storage.lock import JobLockedError
from storage.parts import list_parts
from tests.helpers.child_process import Child
from tests.helpers.results import done_row


def test_the_lease_on_s3_admits_one_coordinator_and_takes_over_one_that_stopped_renewing(s3: str) -> None:
    lock = Location.of(f"{s3}/lease-job/.lock")
    held = job_lock(lock)
    assert isinstance(held, JobLease)
    with held:
        with pytest.raises(JobLockedError, match="in use by a running coordinator"):
            JobLease(lock).acquire()
    assert not lock.exists(), "release removes the record"
    # a record whose clock says it is still valid for an hour, from a machine that stopped renewing it:
    # no clock is compared; a full TTL without a change on the taker's own clock is what counts
    stopped = {"host": "lost-node", "pid": 1, "start_time": 0.0, "token": "x", "expires": time.time() + 3600}
    lock.write_bytes_atomic(json.dumps(stopped).encode(), ".lock.tmp")
    started = time.monotonic()
    with JobLease(lock, ttl_s=1.0) as taken:
        assert time.monotonic() - started >= 1.0, "the taker watched the lease for a full TTL first"
        assert "pid 1 on host lost-node" in taken.takeover_message and "lease expired" in taken.takeover_message


def test_a_lease_renewed_from_another_host_is_refused_whatever_its_clock_says(s3: str) -> None:
    lock = Location.of(f"{s3}/renewed-job/.lock")
    stop = threading.Event()

    def renew_elsewhere() -> None:  # a coordinator on another machine, whose wall clock is a day behind
        seq = 0
        while not stop.is_set():
            seq += 1
            record = {"host": "other-node", "pid": 7, "start_time": 0.0, "token": "y", "seq": seq,
                      "expires": time.time() - 86400}
            lock.write_bytes_atomic(json.dumps(record).encode(), f".lock.{seq}.tmp")
            stop.wait(0.2)

    renewer = threading.Thread(target=renew_elsewhere)
    renewer.start()
    try:
        while not lock.exists():
            time.sleep(0.05)
        with pytest.raises(JobLockedError, match="other-node.*keeps renewing"):
            JobLease(lock, ttl_s=2.0).acquire()
    finally:
        stop.set()
        renewer.join()


def test_a_lease_renewal_refused_by_the_store_stops_every_write(s3: str, tmp_path) -> None:
    """A holder whose lease was taken (its If-Match renewal fails) raises at the fence, publishes nothing."""
    job = Location.of(f"{s3}/fenced-job")
    with JobLease(job / ".lock", ttl_s=1.0) as lease:
        log = CheckpointLog(job, flush_every=1, fence=lease.check)
        log.add_result(done_row("a"))
        taker_record = {"host": "other-node", "pid": 7, "start_time": 0.0, "token": "z"}
        (job / ".lock").write_bytes_atomic(json.dumps(taker_record).encode(), ".lock.taker.tmp")
        deadline = time.monotonic() + 10
        while lease.lost is None:
            assert time.monotonic() < deadline, "the renewal never noticed the takeover"
            time.sleep(0.05)
        with pytest.raises(LeaseLostError, match="another coordinator took it over"):
            log.add_result(done_row("b"))
        with pytest.raises(LeaseLostError):
            compact(job, lease.check)
        with pytest.raises(LeaseLostError):  # and stops its interval flusher, which retried every 5 s for good
            log.close()
    assert json.loads((job / ".lock").read_bytes())["token"] == "z", "the lost lease's release left the taker's record"
    assert load_state(job).done_task_ids == {"t-a"} and len(list_parts(job / "results")) == 1


#: takes the job lease of argv[1] (TTL argv[2]) in its own process and holds it: a resume's coordinator
TAKER = """
import logging, sys, time
from storage.lease import JobLease
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
lease = JobLease(sys.argv[1], ttl_s=float(sys.argv[2]))
lease.acquire()
print(f"held since {time.monotonic()}", flush=True)
time.sleep(600)
"""


def test_a_taker_refused_while_another_takes_over_a_dead_lease_names_the_live_one(s3: str) -> None:
    """A killed coordinator's lease (from another host: judged only by a TTL without renewal); resume A
    waits it out and takes it, resume B, which began waiting meanwhile, is refused naming A, never the dead one."""
    lock = Location.of(f"{s3}/dead-lease-job/.lock")
    killed = {"host": "lost-node", "pid": 4242, "start_time": 0.0, "token": "k", "expires": time.time() + 3600}
    lock.write_bytes_atomic(json.dumps(killed).encode(), ".lock.tmp")
    a = Child(TAKER, str(lock), "3")
    try:
        assert "waiting up to" in a.read_line()  # A watches the dead lease
        b_started = time.monotonic()
        with pytest.raises(JobLockedError) as refused:
            JobLease(lock, ttl_s=3.0).acquire()
        while not (line := a.read_line()).startswith("held since "):
            pass  # A's takeover message
        a_took = float(line.split()[-1])
        assert b_started < a_took, "B began waiting before A took the lease over"
        assert f"pid {a.pid} on host" in str(refused.value) and "4242" not in str(refused.value), refused.value
    finally:
        a.kill()

