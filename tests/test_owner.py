"""Owner records: a clock step (NTP, VM resume) never makes a live owner look dead or reused.

The wall clock cannot be stepped from a test, so the step is made where it enters psutil: the boot
time it adds to every process's start (`/proc/stat` btime, which the kernel derives from the
current wall clock and which moves when the clock is stepped). Everything else is real: real
processes, real /proc, a real sweep and a real lock.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import psutil._pslinux as pslinux
import pytest

from storage.lock import JobLock, JobLockedError
from storage.owner import OwnerLiveness, ProcessOwner
from storage.scratch import sweep_orphans
from tests.helpers.child_process import Child

HOLD_SCRATCH = """
import sys, time
from pathlib import Path
from storage.scratch import task_scratch
with task_scratch(Path(sys.argv[1]), "job1", "t000001", 1) as scratch:
    print(scratch, flush=True)
    time.sleep(600)
"""


@pytest.fixture(params=[1.0, -1.0], ids=["clock-forward-1s", "clock-back-1s"])
def clock_step(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """After this, psutil sees the wall clock stepped by the parameter's seconds."""
    real_boot_time = pslinux.boot_time
    pid = psutil.Process().pid
    before = psutil.Process(pid).create_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot_time() + request.param)
    shifted = psutil.Process(pid).create_time()
    assert shifted - before == pytest.approx(request.param, abs=0.02), "the step reached psutil's start times"
    return request.param


def test_a_clock_step_does_not_make_this_process_look_reused_or_dead(clock_step: float) -> None:
    me = ProcessOwner.current()
    record = ProcessOwner.from_dict({**me.to_dict(), "start_time": me.start_time - clock_step})  # written before the step
    assert record.liveness() == OwnerLiveness.ALIVE
    assert record == me  # the same process, whatever the wall clock says


def test_a_clock_step_does_not_let_the_sweep_delete_a_live_owners_dir(tmp_path: Path, clock_step: float) -> None:
    live = Child(HOLD_SCRATCH, str(tmp_path / "kv"))
    try:
        live_dir = Path(live.read_line())
        recorded = json.loads((live_dir / ".owner.json").read_text())
        assert abs(psutil.Process(live.pid).create_time() - recorded["start_time"]) >= 0.9  # the step is seen
        assert sweep_orphans(tmp_path / "kv") == []
        assert live_dir.is_dir()
    finally:
        live.kill()
    assert [swept.path for swept in sweep_orphans(tmp_path / "kv")] == [live_dir]


def test_a_clock_step_does_not_let_a_second_coordinator_take_a_live_lock(tmp_path: Path, monkeypatch) -> None:
    holder = Child("""
        import sys, time
        from storage.lock import JobLock
        with JobLock(sys.argv[1]):
            print("locked", flush=True)
            time.sleep(600)
        """, str(tmp_path / ".lock"))
    try:
        assert holder.read_line() == "locked"
        real_boot_time = pslinux.boot_time
        monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot_time() + 1.0)
        assert ProcessOwner.from_dict(json.loads((tmp_path / ".lock").read_text())).liveness() == OwnerLiveness.ALIVE
        with pytest.raises(JobLockedError, match=f"pid {holder.pid}"):
            JobLock(tmp_path / ".lock").acquire()
    finally:
        holder.kill()


def test_another_start_on_the_same_pid_is_a_reused_pid_and_another_boot_is_dead() -> None:
    me = ProcessOwner.current()
    assert me.start_ticks is not None and me.boot_id, "this machine has /proc: ticks and boot id are recorded"
    assert ProcessOwner.from_dict({**me.to_dict(), "start_ticks": me.start_ticks - 1}).liveness() == OwnerLiveness.PID_REUSED
    assert ProcessOwner.from_dict({**me.to_dict(), "boot_id": "an-earlier-boot"}).liveness() == OwnerLiveness.DEAD


def test_a_record_without_ticks_from_an_older_kvbatch_is_still_understood() -> None:
    me = ProcessOwner.current()
    old = {"host": me.host, "pid": me.pid, "start_time": me.start_time}
    assert ProcessOwner.from_dict(old).liveness() == OwnerLiveness.ALIVE
    assert ProcessOwner.from_dict({**old, "start_time": me.start_time - 500}).liveness() == OwnerLiveness.PID_REUSED
