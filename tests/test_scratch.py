"""Per-task scratch dirs: isolated, removed however a task ends, orphans swept, disk never filled."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from storage.owner import ProcessOwner
from storage.scratch import (
    OFFLOAD_ROOT_ENV,
    OWNER_FILE,
    OWNERLESS_GRACE_S,
    ROOT_MARKER,
    ScratchError,
    ScratchSpaceError,
    UnsafeOffloadRootError,
    ensure_offload_root,
    offload_root_of,
    sweep_orphans,
    task_scratch,
)
from tests.helpers.child_process import Child
from tests.helpers.system import mounted_tmpfs

HOLD_SCRATCH = """
import sys, time
from pathlib import Path
from storage.scratch import task_scratch
root, job, task = sys.argv[1:4]
with task_scratch(Path(root), job, task, 1) as scratch:
    (scratch / "block-0.zst").write_bytes(b"k" * 10000)
    print(scratch, flush=True)
    time.sleep(600)
"""


HOLD_CLAIM = """
import sys, time
from pathlib import Path
from storage.scratch import task_scratch
root, claim, written, flag = sys.argv[1:5]
with task_scratch(Path(root), "running-job", "t000001", 1, claim_bytes=int(claim)) as scratch:
    (scratch / "block-0.zst").write_bytes(b"k" * int(written))
    print(scratch, flush=True)
    while not Path(flag).exists():
        time.sleep(0.05)
"""
MIB = 2**20


def task_dirs(root: Path) -> list[Path]:
    return sorted(p for job in root.iterdir() if job.is_dir() for p in job.iterdir())


def test_dir_is_created_with_owner_and_removed_on_success(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with task_scratch(root, "job1", "t7", 2) as scratch:
        assert scratch == root.resolve() / "job1" / "t7.2"
        owner = json.loads((scratch / OWNER_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        assert owner["job_id"] == "job1" and owner["start_time"] == ProcessOwner.current().start_time
        (scratch / "block").write_bytes(b"x" * 100)
    assert not scratch.exists()
    assert task_dirs(root) == []
    assert (root / ROOT_MARKER).is_file()


def test_dir_is_removed_when_the_task_raises(tmp_path: Path) -> None:
    with pytest.raises(MemoryError):
        with task_scratch(tmp_path / "kv", "job1", "t1", 1) as scratch:
            (scratch / "sub").mkdir()
            (scratch / "sub" / "block").write_bytes(b"x")
            raise MemoryError("simulated OOM inside the task")
    assert not scratch.exists()
    assert task_dirs(tmp_path / "kv") == []


def test_tasks_and_attempts_get_their_own_dirs(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with task_scratch(root, "j", "t1", 1) as a, task_scratch(root, "j", "t1", 2) as b, \
            task_scratch(root, "j", "t2", 1) as c:
        assert len({a, b, c}) == 3
        with pytest.raises(ScratchError, match="already exists"):
            with task_scratch(root, "j", "t1", 1):
                pass
        assert a.exists()  # the refused duplicate did not remove the live one
    assert task_dirs(root) == []


@pytest.mark.parametrize("job_id, task_id", [("../escape", "t1"), ("j", "a/b"), ("j", ".."), ("", "t1")])
def test_names_that_could_escape_the_layout_are_refused(tmp_path: Path, job_id: str, task_id: str) -> None:
    with pytest.raises(ScratchError, match="cannot name a scratch dir"):
        with task_scratch(tmp_path / "kv", job_id, task_id, 1):
            pass


def test_sigkilled_owner_is_swept_and_live_owner_survives(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    dead, live = Child(HOLD_SCRATCH, str(root), "job1", "t1"), Child(HOLD_SCRATCH, str(root), "job1", "t2")
    try:
        dead_dir, live_dir = Path(dead.read_line()), Path(live.read_line())
        dead.kill()
        assert dead_dir.exists()  # SIGKILL runs no cleanup

        swept = sweep_orphans(root)

        assert [s.path for s in swept] == [dead_dir]
        assert swept[0].owner == f"pid {dead.pid} on host {socket.gethostname()}"
        assert swept[0].reason == "owner process dead" and swept[0].bytes_freed >= 10000
        assert not dead_dir.exists()
        assert (live_dir / "block-0.zst").read_bytes() == b"k" * 10000
        assert sweep_orphans(root) == []
    finally:
        dead.kill()
        live.kill()
    assert [s.path for s in sweep_orphans(root)] == [live_dir]
    assert not (root / "job1").exists()


def make_task_dir(root: Path, job: str, name: str, owner: dict | None) -> Path:
    task_dir = root / job / name
    task_dir.mkdir(parents=True)
    if owner is not None:  # kvbatch's owner file always names the job its dir belongs to
        (task_dir / OWNER_FILE).write_text(json.dumps({"job_id": job, **owner}))
    return task_dir


def test_pid_reuse_ownerless_and_other_host_dirs(tmp_path: Path) -> None:
    root = ensure_offload_root(tmp_path / "kv")
    me = ProcessOwner.current()
    reused = make_task_dir(root, "j", "t1.1", {**me.to_dict(), "start_ticks": me.start_ticks - 500})
    other_host = make_task_dir(root, "j", "t2.1", {**me.to_dict(), "host": "some-other-node"})
    fresh_ownerless = make_task_dir(root, "j", "t3.1", None)
    old_ownerless = make_task_dir(root, "j", "t4.1", None)
    long_ago = time.time() - OWNERLESS_GRACE_S - 60
    os.utime(old_ownerless, (long_ago, long_ago))

    swept = {s.path: s.reason for s in sweep_orphans(root)}

    assert swept.keys() == {reused, old_ownerless}
    assert swept[reused] == "owner process pid reused"
    assert "no owner file" in swept[old_ownerless]
    assert other_host.exists() and fresh_ownerless.exists()


def test_sweep_never_follows_symlinks(tmp_path: Path) -> None:
    root = ensure_offload_root(tmp_path / "kv")
    victim = tmp_path / "precious"
    (victim / "t1.1").mkdir(parents=True)
    (victim / "t1.1" / "data").write_text("keep me")
    (root / "linked-job").symlink_to(victim)
    dead_owner = {"host": socket.gethostname(), "pid": 2**22 + 1, "start_time": 1.0}  # above pid_max
    task_dir = make_task_dir(root, "j", "t2.1", dead_owner)
    (task_dir / "outside").symlink_to(victim)
    (root / "j" / "t3.1").symlink_to(victim / "t1.1")

    swept = sweep_orphans(root)

    assert [s.path for s in swept] == [task_dir]
    assert (victim / "t1.1" / "data").read_text() == "keep me"
    assert (root / "j" / "t3.1").is_symlink()


def test_two_jobs_on_one_root_never_see_each_other(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    worker = """
        import sys, os
        from pathlib import Path
        from storage.scratch import task_scratch
        root, job = Path(sys.argv[1]), sys.argv[2]
        for i in range(60):
            with task_scratch(root, job, f"t{i % 3}", i) as scratch:
                (scratch / f"{job}-block").write_bytes(os.urandom(1000))
                seen = sorted(os.listdir(scratch))
                assert seen == [".owner.json", f"{job}-block"], seen
        print("ok", flush=True)
    """
    jobs = [Child(worker, str(root), "jobA"), Child(worker, str(root), "jobB")]
    for job in jobs:
        assert job.read_line() == "ok"
        job.finish()
    assert task_dirs(root) == []

    dead = {"host": socket.gethostname(), "pid": 2**22 + 1, "start_time": 1.0}
    orphan_a = make_task_dir(root, "jobA", "t1.9", dead)
    orphan_b = make_task_dir(root, "jobB", "t1.9", dead)
    assert [s.path for s in sweep_orphans(root, job_id="jobA")] == [orphan_a]
    assert orphan_b.exists()


def test_root_must_not_be_the_filesystem_root() -> None:
    with pytest.raises(UnsafeOffloadRootError, match="filesystem root"):
        sweep_orphans(Path("/"))
    with pytest.raises(UnsafeOffloadRootError, match="filesystem root"):
        with task_scratch(Path("/"), "j", "t1", 1):
            pass


def test_foreign_folders_are_refused_and_empty_ones_adopted(tmp_path: Path) -> None:
    foreign = tmp_path / "home"
    (foreign / "alice" / "notes.1").mkdir(parents=True)
    with pytest.raises(UnsafeOffloadRootError, match="without the kvbatch marker"):
        sweep_orphans(foreign)
    with pytest.raises(UnsafeOffloadRootError, match="without the kvbatch marker"):
        with task_scratch(foreign, "j", "t1", 1):
            pass
    assert (foreign / "alice" / "notes.1").is_dir()

    empty = tmp_path / "empty"
    empty.mkdir()
    with task_scratch(empty, "j", "t1", 1):
        pass
    assert (empty / ROOT_MARKER).is_file()
    assert sweep_orphans(tmp_path / "never-created") == []


def test_offload_root_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OFFLOAD_ROOT_ENV, raising=False)
    assert offload_root_of(tmp_path / "runs" / "j1") == tmp_path / "runs" / "j1" / "scratch" / "kvbatch"
    monkeypatch.setenv(OFFLOAD_ROOT_ENV, str(tmp_path / "nvme"))
    assert offload_root_of(tmp_path / "runs" / "j1") == tmp_path / "nvme"
    assert offload_root_of(tmp_path / "runs" / "j1", str(tmp_path / "ssd")) == tmp_path / "ssd"  # cache.offload_root


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A 4 MiB tmpfs, unmounted afterwards; skipped where mounting is not permitted."""
    with mounted_tmpfs(tmp_path / "small", "size=4m") as mount_point:
        yield mount_point


def test_small_filesystem_guard_and_enospc_cleanup(small_filesystem: Path) -> None:
    root = small_filesystem / "kvbatch"
    with task_scratch(root, "job1", "t1", 1, claim_bytes=1 * MIB):
        pass
    free_at_start = shutil.disk_usage(small_filesystem).free
    with pytest.raises(ScratchSpaceError, match=r"has 4\.0 MiB free; the task needs 8\.0 MiB") as refused:
        with task_scratch(root, "job1", "t1", 1, claim_bytes=8 * MIB, wait_s=60):  # nothing to wait for
            pass
    assert refused.value.needed_bytes == 8 * MIB and refused.value.free_bytes == free_at_start
    with pytest.raises(ScratchSpaceError):  # fits the bytes, but not with the reserve kept free
        with task_scratch(root, "job1", "t1", 1, claim_bytes=free_at_start - 1000):
            pass
    assert task_dirs(root) == [], "a refused claim left a dir"

    with pytest.raises(OSError) as full:
        with task_scratch(root, "job1", "t1", 1) as scratch:
            with open(scratch / "block-0", "wb") as block:
                while True:
                    block.write(b"\xff" * 65536)
                    block.flush()
    assert full.value.errno == errno.ENOSPC
    assert not scratch.exists()
    assert shutil.disk_usage(small_filesystem).free >= free_at_start - 64 * 1024
    with task_scratch(root, "job1", "t1", 2) as retry:  # the next attempt has the space again
        (retry / "block-0").write_bytes(b"k" * 2**20)


def test_a_dir_that_claims_nothing_opens_on_a_disk_full_past_its_reserve(small_filesystem: Path) -> None:
    # another program filled the disk past the reserve kvbatch keeps free: a task that writes no KV
    # there still gets its dir, while one that claims room is refused
    root = small_filesystem / "kvbatch"
    ensure_offload_root(root)
    with open(small_filesystem / "someone-elses-file", "wb") as other:
        while shutil.disk_usage(small_filesystem).free > 64 * 1024:
            other.write(b"\0" * 65536)
            other.flush()
    with task_scratch(root, "job1", "t000001", 1) as scratch:
        assert scratch.is_dir()
    with pytest.raises(ScratchSpaceError, match=r"the task needs 0\.0 MiB plus a 0\.2 MiB reserve"):
        with task_scratch(root, "job1", "t000002", 1, claim_bytes=1024):
            pass
    assert task_dirs(root) == []


def test_a_claim_counts_against_the_disk_before_its_bytes_are_written(small_filesystem: Path, tmp_path: Path) -> None:
    # another process's task claimed 2.5 MiB of the 4 MiB and has written 0.5 MiB: 3.5 MiB are free,
    # but only 1.5 MiB are not promised
    root = small_filesystem / "kvbatch"
    running = Child(HOLD_CLAIM, str(root), str(5 * MIB // 2), str(MIB // 2), str(tmp_path / "done"))
    try:
        running.read_line()
        assert shutil.disk_usage(small_filesystem).free > 3 * MIB
        started = time.monotonic()
        with pytest.raises(ScratchSpaceError, match=r"2\.0 MiB of it claimed by 1 running task\(s\)"):
            with task_scratch(root, "job2", "t000001", 1, claim_bytes=5 * MIB // 2, wait_s=0.5):
                pass
        assert time.monotonic() - started >= 0.5, "it did not wait for the running task"
        with task_scratch(root, "job2", "t000002", 1, claim_bytes=MIB):  # what is not promised is there
            pass
    finally:
        (tmp_path / "done").touch()
        running.finish()


def test_a_claim_that_fits_once_running_tasks_end_waits_for_them(small_filesystem: Path, tmp_path: Path) -> None:
    root = small_filesystem / "kvbatch"
    running = Child(HOLD_CLAIM, str(root), str(5 * MIB // 2), "0", str(tmp_path / "done"))
    running.read_line()
    entered: list[float] = []

    def claim() -> None:
        with task_scratch(root, "job2", "t000001", 1, claim_bytes=5 * MIB // 2, wait_s=120):
            entered.append(time.monotonic())

    waiting = threading.Thread(target=claim)
    waiting.start()
    time.sleep(1.0)
    assert not entered and waiting.is_alive(), "the second claim did not wait for the room"
    ended = time.monotonic()
    (tmp_path / "done").touch()
    running.finish()
    waiting.join(timeout=30)
    assert entered and entered[0] >= ended, "the second claim ran before the first one ended"
    assert task_dirs(root) == []


def test_a_dead_owners_claim_ends_with_it(small_filesystem: Path, tmp_path: Path) -> None:
    root = small_filesystem / "kvbatch"
    killed = Child(HOLD_CLAIM, str(root), str(5 * MIB // 2), "10000", str(tmp_path / "never"))
    killed.read_line()
    killed.kill()  # its dir stays (until swept) with what it wrote, but it claims nothing more
    with task_scratch(root, "job2", "t000001", 1, claim_bytes=5 * MIB // 2):
        pass


def test_a_claim_too_big_for_the_disk_without_running_tasks_does_not_wait(small_filesystem: Path,
                                                                          tmp_path: Path) -> None:
    root = small_filesystem / "kvbatch"
    running = Child(HOLD_CLAIM, str(root), str(MIB), "0", str(tmp_path / "done"))
    try:
        running.read_line()
        started = time.monotonic()
        with pytest.raises(ScratchSpaceError, match=r"the task needs 5\.0 MiB"):
            with task_scratch(root, "job2", "t000001", 1, claim_bytes=5 * MIB, wait_s=120):
                pass
        assert time.monotonic() - started < 10
    finally:
        (tmp_path / "done").touch()
        running.finish()


DEAD = {"host": socket.gethostname(), "pid": 2**22 + 1, "start_time": 1.0}  # above pid_max: never alive


def test_a_job_folder_swapped_for_a_symlink_mid_sweep_is_never_followed(tmp_path: Path, monkeypatch) -> None:
    root = ensure_offload_root(tmp_path / "kv")
    orphan = make_task_dir(root, "j", "t1.1", DEAD)
    victim = tmp_path / "precious"
    (victim / "t1.1").mkdir(parents=True)
    (victim / "t1.1" / "data").write_text("keep me")
    swapped = []
    real_liveness = ProcessOwner.liveness

    def liveness_then_swap(owner: ProcessOwner):
        """A writer of the root swaps the job folder for a symlink once the sweep has judged the dir."""
        result = real_liveness(owner)
        if not swapped:
            (root / "j").rename(root / "j-moved")
            (root / "j").symlink_to(victim)
            swapped.append(True)
        return result

    monkeypatch.setattr(ProcessOwner, "liveness", liveness_then_swap)
    swept = sweep_orphans(root)

    assert swapped, "the swap happened between judging the dir and deleting it"
    assert (victim / "t1.1" / "data").read_text() == "keep me"
    assert [s.path for s in swept] == [orphan] and not (root / "j-moved" / "t1.1").exists()
    assert (root / "j").is_symlink()


def test_only_task_dirs_with_kvbatchs_owner_file_are_swept(tmp_path: Path) -> None:
    root = ensure_offload_root(tmp_path / "kv")
    version_folder = make_task_dir(root, "j", "v1.2", DEAD)  # an ordinary folder name with a dot and digits
    other_job = make_task_dir(root, "j", "t2.1", {**DEAD, "job_id": "another-job"})
    foreign_owner_file = make_task_dir(root, "j", "t3.1", None)
    (foreign_owner_file / OWNER_FILE).write_text('{"hello": "world"}')
    user_files = make_task_dir(root, "j", "t4.1", None)
    (user_files / "thesis.tex").write_text("years of work")
    crash_remains = make_task_dir(root, "j", "t5.1", None)
    (crash_remains / f"{OWNER_FILE}.tmp").write_text("{")
    ours = make_task_dir(root, "j", "t6.1", DEAD)
    long_ago = time.time() - OWNERLESS_GRACE_S - 60
    for folder in (version_folder, other_job, foreign_owner_file, user_files, crash_remains, ours):
        os.utime(folder, (long_ago, long_ago))

    swept = {s.path for s in sweep_orphans(root)}

    assert swept == {crash_remains, ours}
    assert (version_folder / OWNER_FILE).exists() and (user_files / "thesis.tex").exists()
    assert other_job.exists() and foreign_owner_file.exists()


def test_a_marked_root_is_adopted_only_when_it_is_this_users_alone(tmp_path: Path) -> None:
    shared = ensure_offload_root(tmp_path / "shared")
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeOffloadRootError, match=r"writable by group or others \(mode 777\).*chmod go-w"):
        ensure_offload_root(shared)
    with pytest.raises(UnsafeOffloadRootError, match="writable by group or others"):
        sweep_orphans(shared)
    os.chmod(shared, 0o755)
    assert ensure_offload_root(shared) == shared

    if os.geteuid() == 0:
        foreign = ensure_offload_root(tmp_path / "foreign")
        os.chown(foreign, 65534, 65534)
    else:
        foreign = Path("/usr")  # a folder of another user (root) on every Linux machine
    with pytest.raises(UnsafeOffloadRootError, match="not to this user"):
        ensure_offload_root(foreign)


def test_the_default_root_of_a_job_on_object_storage_is_private_to_the_user(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(OFFLOAD_ROOT_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = offload_root_of("s3://bucket/jobs/j1?region=us-east-1")
    assert root == tmp_path / "home" / ".cache" / "kvbatch" / "offload"
    ensure_offload_root(root)
    assert root.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert offload_root_of("s3://bucket/jobs/j1?region=us-east-1") == tmp_path / "xdg" / "kvbatch" / "offload"


KILLED_MAKING_ITS_DIR = """
import os, sys, time
from pathlib import Path
from storage.scratch import task_scratch

def stop_before_publishing(*args, **kwargs):  # the last step of making a task dir is a rename
    print("made, not yet published", flush=True)
    time.sleep(600)

os.rename = stop_before_publishing
with task_scratch(Path(sys.argv[1]), "job1", "t000001", 1, pass_at=(0, 8)):
    pass
"""


def test_a_worker_killed_while_making_its_task_dir_leaves_nothing_a_sweep_keeps(tmp_path: Path) -> None:
    """A worker killed between creating a task dir and publishing its owner (seen in CI: a worker SIGKILLed as
    its batch's passes began) must leave nothing that the restarted worker's sweep keeps for minutes."""
    root = tmp_path / "kv"
    child = Child(KILLED_MAKING_ITS_DIR, str(root))
    assert child.read_line() == "made, not yet published"
    child.kill()
    assert [p.name for p in (root / "job1").iterdir()], "the killed process left what it was making"
    swept = sweep_orphans(root)
    assert [d.owner for d in swept] == [f"pid {child.pid} on host {socket.gethostname()}"]
    assert sorted(p.name for p in root.iterdir()) == [ROOT_MARKER]
