"""Per-task scratch dirs: `<offload_root>/<job_id>/<task_id>.<attempt>/`, one per task attempt.

Each holds an owner file and the task's KV blocks and is removed when the task's block ends; a dir whose
owner died is swept later by `sweep_orphans` (docs/cluster.md, "Offload directories"). The sweep deletes
only kvbatch's dirs whose owner is verifiably gone, under a marked root only this user can write, through
O_NOFOLLOW directory fds, so a folder swapped for a symlink is never followed.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from storage.location import Location, Where
from storage.owner import OwnerLiveness, ProcessOwner, boot_id
from storage.scratch_space import Claim, Room, room_claimed

OFFLOAD_ROOT_ENV = "KVBATCH_OFFLOAD_ROOT"
ROOT_MARKER = ".kvbatch-offload-root"
OWNER_FILE = ".owner.json"
#: A task dir with no owner file (made by a kvbatch that did not stage them, or its file deleted) is swept this old.
OWNERLESS_GRACE_S = 300.0

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
#: Task ids are `t` and the manifest row (`jobs.manifest.task_id_for_row`); a folder such as `v1.2` is not a task dir.
_TASK_ID = re.compile(r"t\d{1,20}")
_TASK_DIR_NAME = re.compile(r"t\d{1,20}\.\d{1,20}(l\d{1,20}p\d{1,20})?")
#: A task dir being made: `.<task dir name>.<owner pid>.<owner start ticks>` (`_make_task_dir`).
_STAGING_NAME = re.compile(r"\.(t\d{1,20}\.\d{1,20}(?:l\d{1,20}p\d{1,20})?)\.(\d{1,10})\.(\d{1,20})")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ScratchError(RuntimeError):
    """A scratch dir or offload root that cannot be used; the message says which and why."""


class UnsafeOffloadRootError(ScratchError):
    """The offload root is '/', or an existing folder kvbatch did not create."""


class ScratchSpaceError(ScratchError):
    """The offload root's filesystem does not have room for the task."""

    def __init__(self, message: str, free_bytes: int, needed_bytes: int) -> None:
        super().__init__(message)
        self.free_bytes = free_bytes
        self.needed_bytes = needed_bytes


@dataclass(frozen=True)
class SweptDir:
    path: Path
    job_id: str
    owner: str  # "pid N on host H", or why no owner could be named
    reason: str
    bytes_freed: int


def offload_root_of(job_dir: Where, configured: str | None = None) -> Path:
    """`configured` (the job's `cache.offload_root`) when given, else $KVBATCH_OFFLOAD_ROOT when set, else
    JOB_DIR/scratch/kvbatch (gone with the job folder; point either at a node-local NVMe folder for KV offload);
    for a job folder on shared storage, $XDG_CACHE_HOME/kvbatch/offload, private to the user (0700), never a
    predictable name in a shared /tmp."""
    if configured := configured or os.environ.get(OFFLOAD_ROOT_ENV, "").strip():
        return Path(configured)
    job = Location.of(job_dir)
    if job.is_local:
        return job.local_path / "scratch" / "kvbatch"
    return shared_storage_offload_root()


def shared_storage_offload_root() -> Path:
    """The default offload root of every job folder on shared storage: $XDG_CACHE_HOME/kvbatch/offload."""
    cache_home = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(cache_home) if os.path.isabs(cache_home) else Path.home() / ".cache") / "kvbatch" / "offload"


def _check_not_filesystem_root(offload_root: Path) -> Path:
    resolved = Path(offload_root).resolve()
    if resolved == Path(resolved.anchor):
        raise UnsafeOffloadRootError(
            f"offload root {offload_root} is the filesystem root; set cache.offload_root "
            f"(or ${OFFLOAD_ROOT_ENV}) to a dedicated folder such as /mnt/nvme/kvbatch"
        )
    return resolved


def _not_a_kvbatch_root(offload_root: Path) -> UnsafeOffloadRootError:
    return UnsafeOffloadRootError(
        f"offload root {offload_root} is an existing folder without the kvbatch marker file {ROOT_MARKER}; "
        f"kvbatch only deletes inside folders it created. Point cache.offload_root at a new or empty "
        f"folder (for example {offload_root / 'kvbatch'})"
    )


def _check_private(offload_root: Path, info: os.stat_result) -> None:
    """A root someone else can write is one where they can plant dirs (or symlinks) for us to delete."""
    if info.st_uid != os.geteuid():
        raise UnsafeOffloadRootError(
            f"offload root {offload_root} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}); "
            f"kvbatch only uses and deletes inside its own folders. Point cache.offload_root "
            f"(or ${OFFLOAD_ROOT_ENV}) at a folder of your own"
        )
    if info.st_mode & 0o022:
        raise UnsafeOffloadRootError(
            f"offload root {offload_root} is writable by group or others (mode {info.st_mode & 0o777:o}); "
            f"run `chmod go-w {offload_root}` or point cache.offload_root at a private folder"
        )


def ensure_offload_root(offload_root: Path) -> Path:
    """Create (or adopt, when empty or marked) the root and its marker; refuse '/', foreign or shared folders."""
    root = _check_not_filesystem_root(offload_root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_offload_root(offload_root)
    marker = root / ROOT_MARKER
    if not marker.is_file():
        marker.write_text(f"kvbatch offload root, created {time.ctime()} on {socket.gethostname()}\n")
    return root


def check_offload_root(offload_root: Path) -> None:
    """What `ensure_offload_root` would refuse, checked at submit without creating anything (none yet is fine)."""
    root = _check_not_filesystem_root(offload_root)
    if not root.exists():
        return
    if not root.is_dir():
        raise UnsafeOffloadRootError(
            f"offload root {offload_root} is a file, not a folder; point cache.offload_root "
            f"(or ${OFFLOAD_ROOT_ENV}) at a new or empty folder"
        )
    _check_private(offload_root, os.stat(root))
    marker = root / ROOT_MARKER
    # unmarked and not empty: not kvbatch's (the marker is looked for again: another worker may have just made it)
    if not marker.is_file() and any(e.name != ROOT_MARKER for e in os.scandir(root)) and not marker.is_file():
        raise _not_a_kvbatch_root(offload_root)


def _make_task_dir(job_dir: Path, task_dir: Path, record: dict[str, Any]) -> None:
    """`task_dir` with its owner file `record` in it. It is made under a staging name that says whose it is
    (`_STAGING_NAME`), filled, then renamed: a process killed at any point leaves nothing a sweep cannot judge."""
    staging = job_dir / f".{task_dir.name}.{record['pid']}.{record['start_ticks'] or 0}"
    for _ in range(10):  # a concurrent task end may remove the empty job dir between our two mkdirs
        job_dir.mkdir(exist_ok=True)
        try:
            staging.mkdir()
            break
        except FileNotFoundError:
            continue
        except FileExistsError:
            raise _exists(task_dir) from None
    else:
        raise ScratchError(f"could not create scratch dir {task_dir}: its job folder kept disappearing")
    try:
        (staging / OWNER_FILE).write_text(json.dumps(record))
        os.rename(staging, task_dir)
    except BaseException as e:  # an interrupt too: a live process's staging dir is never swept
        shutil.rmtree(staging, ignore_errors=True)
        if getattr(e, "errno", None) in (errno.EEXIST, errno.ENOTEMPTY):
            raise _exists(task_dir) from None
        raise


def _exists(task_dir: Path) -> ScratchError:
    return ScratchError(f"scratch dir {task_dir} already exists: another process runs this task attempt, or a "
                        f"crashed one left it (run `kvbatch clean` to remove dirs whose owner is gone)")


@contextmanager
def task_scratch(offload_root: Path, job_id: str, task_id: str, attempt: int, claim_bytes: int = 0,
                 wait_s: float = 0.0, pass_at: tuple[int, int] | None = None) -> Iterator[Path]:
    """A fresh dir for one task attempt (or one pass of it, `pass_at`: several run at once), removed when the
    block ends however it ends. `claim_bytes` is claimed against the live task dirs' claims, waiting up to
    `wait_s` for room they hold (storage.scratch_space); ScratchSpaceError when it cannot fit."""
    if not _SAFE_NAME.fullmatch(job_id):
        raise ScratchError(
            f"job id {job_id!r} cannot name a scratch dir: use letters, digits, '_', '-' and '.' "
            f"(not first), at most 200 characters"
        )
    if not _TASK_ID.fullmatch(task_id):
        raise ScratchError(f"task id {task_id!r} cannot name a scratch dir: task ids are 't' and digits")
    if attempt < 0:
        raise ScratchError(f"attempt must be >= 0, got {attempt} for task {task_id}")
    root = ensure_offload_root(offload_root)
    job_dir = root / job_id
    task_dir = job_dir / (f"{task_id}.{attempt}" + (f"l{pass_at[0]:d}p{pass_at[1]:d}" if pass_at else ""))
    claimed = (room_claimed(root, root / ROOT_MARKER, claim_bytes, wait_s, lambda: live_claims(root),
                            partial(_no_room, offload_root)) if claim_bytes else nullcontext())
    with claimed:
        _make_task_dir(job_dir, task_dir, {**ProcessOwner.current().to_dict(), "job_id": job_id,
                                           "created": time.time(), "claimed_bytes": claim_bytes})
    try:
        yield task_dir
    finally:
        _remove_task_dir(job_dir, task_dir)


def _remove_task_dir(job_dir: Path, task_dir: Path) -> None:
    shutil.rmtree(task_dir, ignore_errors=True)
    with suppress(OSError):
        job_dir.rmdir()  # only succeeds when this was the job's last task dir


def _open_dir(name: str | Path, dir_fd: int | None = None) -> int | None:
    """An fd of the real directory `name` (in `dir_fd`); None for a symlink, a file or nothing."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:  # ELOOP/ENOTDIR for a symlink or a file, ENOENT when removed meanwhile
        return None


def _subdir_names(dir_fd: int) -> list[str]:
    """Names of the real subdirectories (never symlinks) in the directory `dir_fd`."""
    names = []
    for name in os.listdir(dir_fd):
        with suppress(FileNotFoundError):
            if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                names.append(name)
    return names


def _tree_bytes(dir_fd: int) -> int:
    total = 0
    for _, _, files, folder_fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in files:
            with suppress(FileNotFoundError):
                total += os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_size
    return total


def _read_owner(task_fd: int) -> dict | None:
    """The owner record in the task dir `task_fd`; None when it has no owner file (a symlink is none)."""
    try:
        fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=task_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return {}  # there, but not a file we can read: not ours to judge
    with os.fdopen(fd, "rb") as handle:
        try:
            record = json.loads(handle.read(65536))
        except ValueError:
            return {}
    return record if isinstance(record, dict) else {}


def _orphan_reason(task_fd: int, name: str, job_id: str) -> tuple[str, str] | None:
    """(owner, reason) when the dir's owner is gone; None when it may be alive or the dir is not surely ours."""
    if staged := _STAGING_NAME.fullmatch(name):  # judged by its name: its owner file may be half written
        ticks, boot = int(staged[3]), boot_id()
        if not ticks or boot is None:
            return None
        owner = ProcessOwner(socket.gethostname(), int(staged[2]), 0.0, ticks, boot)
        liveness = owner.liveness()
        return None if liveness is OwnerLiveness.ALIVE else (owner.describe(), f"owner process {liveness.value}")
    record = _read_owner(task_fd)
    if record is None:
        # a dir made before task dirs were staged, by a crash between its mkdir and its owner file
        if set(os.listdir(task_fd)) - {f"{OWNER_FILE}.tmp"}:
            return None
        age = time.time() - os.fstat(task_fd).st_mtime
        if age < OWNERLESS_GRACE_S:
            return None
        return "unknown", f"no owner file for {age:.0f} s"
    if record.get("job_id") != job_id:
        return None  # not an owner file kvbatch wrote for this job folder
    try:
        owner = ProcessOwner.from_dict(record)
    except ValueError:
        return None
    liveness = owner.liveness()
    if liveness in (OwnerLiveness.ALIVE, OwnerLiveness.OTHER_HOST):
        return None
    return owner.describe(), f"owner process {liveness.value}"


def _sweep_task_dir(job_fd: int, name: str, task_fd: int, path: Path, job_id: str) -> SweptDir | None:
    """Remove the orphaned task dir `name` (`task_fd`) of the job dir `job_fd`; None when it is not one."""
    orphan = _orphan_reason(task_fd, name, job_id)
    if orphan is None:
        return None
    size = _tree_bytes(task_fd)
    judged = os.fstat(task_fd)
    try:  # the entry must still be the directory that was judged
        if not os.path.samestat(judged, os.stat(name, dir_fd=job_fd, follow_symlinks=False)):
            return None
    except FileNotFoundError:
        return None
    shutil.rmtree(name, dir_fd=job_fd, ignore_errors=True)  # fd-based: refuses a symlink, never follows one
    return SweptDir(path, job_id, orphan[0], orphan[1], size)


def _task_dirs(root_fd: int, job_id: str | None = None, prune: bool = False) -> Iterator[tuple[int, str, str, int]]:
    """(job dir fd, job name, task dir name, task dir fd) of each task dir under the root `root_fd` (only
    `job_id`'s when given); `prune` removes each job dir that is left empty."""
    for job_name in _subdir_names(root_fd):
        job_fd = _open_dir(job_name, root_fd) if job_id in (None, job_name) else None
        if job_fd is None:
            continue
        try:
            for task_name in _subdir_names(job_fd):
                ours = _TASK_DIR_NAME.fullmatch(task_name) or _STAGING_NAME.fullmatch(task_name)
                task_fd = _open_dir(task_name, job_fd) if ours else None
                if task_fd is not None:
                    try:
                        yield job_fd, job_name, task_name, task_fd
                    finally:
                        os.close(task_fd)
        finally:
            os.close(job_fd)
        if prune:
            with suppress(OSError):
                os.rmdir(job_name, dir_fd=root_fd)  # only succeeds when the job has no dir left


def sweep_orphans(offload_root: Path, job_id: str | None = None) -> list[SweptDir]:
    """Remove task dirs (of every job, or just `job_id`) whose owner process on this host is gone."""
    root = _check_not_filesystem_root(offload_root)
    if not root.exists():
        return []
    if (root_fd := _open_dir(root)) is None:
        raise _not_a_kvbatch_root(offload_root)
    try:
        try:
            marked = stat.S_ISREG(os.stat(ROOT_MARKER, dir_fd=root_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            marked = False
        if not marked:
            raise _not_a_kvbatch_root(offload_root)
        _check_private(offload_root, os.fstat(root_fd))
        swept = [_sweep_task_dir(job_fd, task, task_fd, root / job / task, job)
                 for job_fd, job, task, task_fd in _task_dirs(root_fd, job_id, prune=True)]
    finally:
        os.close(root_fd)
    return [done for done in swept if done]


def _no_room(offload_root: Path, room: Room) -> ScratchSpaceError:
    promised = (f", {room.promised_bytes / 2**20:.1f} MiB of it claimed by {len(room.claims)} running task(s)"
                if room.promised_bytes else "")
    return ScratchSpaceError(
        f"offload root {offload_root} has {room.free_bytes / 2**20:.1f} MiB free{promised}; the task needs "
        f"{room.needed_bytes / 2**20:.1f} MiB plus a {room.reserve_bytes / 2**20:.1f} MiB reserve. Use a shorter "
        f"context or point cache.offload_root at a larger disk",
        free_bytes=room.free_bytes,
        needed_bytes=room.needed_bytes,
    )


def live_claims(root: Path) -> tuple[Claim, ...]:
    """Claims of the root's task dirs whose owner may be alive (a dead owner's files already count as used)."""
    if (root_fd := _open_dir(root)) is None:
        return ()
    try:
        claims = [_claim_of(task_fd) for _, _, _, task_fd in _task_dirs(root_fd)]
    finally:
        os.close(root_fd)
    return tuple(claim for claim in claims if claim)


def _claim_of(task_fd: int) -> Claim | None:
    record = _read_owner(task_fd)
    claimed = record.get("claimed_bytes") if record else None
    if not isinstance(claimed, int) or claimed <= 0:
        return None
    try:
        alive = ProcessOwner.from_dict(record).liveness() in (OwnerLiveness.ALIVE, OwnerLiveness.OTHER_HOST)
    except ValueError:
        return None
    return Claim(claimed, _tree_bytes(task_fd)) if alive else None
