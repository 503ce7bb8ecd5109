"""JOB_DIR/.lock: a second live coordinator is refused, a dead one's lock is taken over."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from storage.lock import JobLock, JobLockedError
from storage.owner import ProcessOwner
from tests.helpers.child_process import Child

HOLD_LOCK = """
import sys, time
from storage.lock import JobLock
with JobLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_second_coordinator_is_refused_then_takes_over_when_the_first_dies(tmp_path: Path) -> None:
    lock_path = tmp_path / ".lock"
    holder = Child(HOLD_LOCK, str(lock_path))
    try:
        assert holder.read_line() == "locked"
        with pytest.raises(JobLockedError) as refused:
            JobLock(lock_path).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert str(tmp_path) in message
    finally:
        holder.kill()

    with JobLock(lock_path) as lock:
        assert lock.takeover_message is not None
        assert f"pid {holder.pid}" in lock.takeover_message and "process is gone" in lock.takeover_message
        record = json.loads(lock_path.read_text())
        assert record["pid"] == ProcessOwner.current().pid
    assert not lock_path.exists()


def test_a_refusal_names_the_live_holder_and_never_calls_a_dead_one_running(tmp_path: Path) -> None:
    """kill -9 of a coordinator, resume A takes its lock, resume B is refused naming A; a record that names
    the killed one while A holds the flock (planted) is called gone, not "a running coordinator"."""
    lock_path = tmp_path / ".lock"
    killed = Child(HOLD_LOCK, str(lock_path))
    assert killed.read_line() == "locked"
    killed_record = lock_path.read_text()
    killed.kill()
    taker = Child(HOLD_LOCK, str(lock_path))
    try:
        assert taker.read_line() == "locked"
        with pytest.raises(JobLockedError) as refused:
            JobLock(lock_path).acquire()
        assert f"running coordinator (pid {taker.pid} " in str(refused.value), refused.value
        assert f"pid {killed.pid} " not in str(refused.value), refused.value
        lock_path.write_text(killed_record)  # the same file, its flock still the taker's
        with pytest.raises(JobLockedError) as refused:
            JobLock(lock_path).acquire()
        message = str(refused.value)
        assert "running coordinator" not in message, message
        assert f"pid {killed.pid} on host {socket.gethostname()}, which is no longer running" in message, message
    finally:
        taker.kill()


def test_lock_released_cleanly_is_taken_without_a_message(tmp_path: Path) -> None:
    lock_path = tmp_path / ".lock"
    Child("""
        import sys
        from storage.lock import JobLock
        with JobLock(sys.argv[1]):
            pass
        """, str(lock_path)).finish()
    assert not lock_path.exists()
    with JobLock(lock_path) as lock:
        assert lock.takeover_message is None


def test_two_locks_in_one_process_exclude_each_other(tmp_path: Path) -> None:
    with JobLock(tmp_path / ".lock"):
        with pytest.raises(JobLockedError, match=f"pid {ProcessOwner.current().pid}"):
            JobLock(tmp_path / ".lock").acquire()


def write_record(lock_path: Path, owner: ProcessOwner) -> None:
    lock_path.write_text(json.dumps(owner.to_dict()))


def test_record_whose_pid_was_reused_is_stale(tmp_path: Path) -> None:
    me = ProcessOwner.current()
    write_record(tmp_path / ".lock", ProcessOwner(me.host, me.pid, me.start_time - 1000))
    with JobLock(tmp_path / ".lock") as lock:
        assert "its pid now belongs to another process" in lock.takeover_message


def test_record_of_a_live_process_is_respected_even_without_its_flock(tmp_path: Path) -> None:
    """Guard for filesystems where flock is a no-op: the record alone still names a live owner."""
    sleeper = Child("import time; print('up', flush=True); time.sleep(600)")
    try:
        assert sleeper.read_line() == "up"
        write_record(tmp_path / ".lock", ProcessOwner.of_pid(sleeper.pid))
        with pytest.raises(JobLockedError, match=f"pid {sleeper.pid}"):
            JobLock(tmp_path / ".lock").acquire()
    finally:
        sleeper.kill()


def test_unreadable_record_does_not_block(tmp_path: Path) -> None:
    (tmp_path / ".lock").write_text("{ torn")
    with JobLock(tmp_path / ".lock") as lock:
        assert lock.takeover_message is None
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == ProcessOwner.current().pid
