"""Per-task scratch dirs: `<offload_root>/<job_id>/<task_id>.<attempt>/`, one per task attempt.

Each dir holds an owner file (host, pid, process start time, job id) and the task's KV blocks. It
is removed when the task's block ends, however it ends; a dir whose owner process died (SIGKILL,
OOM killer, power loss) is swept later by `sweep_orphans`. Sweeping only ever deletes
`<job_id>/<task_id>.<attempt>` dirs under a root that carries the kvbatch marker file, whose
owner on this host is verifiably gone, and never follows a symlink.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from storage.location import Location, Where
from storage.owner import OwnerLiveness, ProcessOwner

OFFLOAD_ROOT_ENV = "KVBATCH_OFFLOAD_ROOT"
ROOT_MARKER = ".kvbatch-offload-root"
OWNER_FILE = ".owner.json"
#: A dir without a readable owner file is one being created right now, or the remains of a crash
#: between mkdir and writing the owner file; only the latter is this old.
OWNERLESS_GRACE_S = 300.0
#: Never plan to use the last of a filesystem: keep min(256 MiB, 5% of its size) free.
RESERVE_BYTES_MAX = 256 * 2**20
RESERVE_FRACTION = 0.05

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
_TASK_DIR_NAME = re.compile(r"(?P<task_id>.+)\.(?P<attempt>\d+)")


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


def default_offload_root(job_dir: Where) -> Path:
    """$KVBATCH_OFFLOAD_ROOT when set, else JOB_DIR/scratch/kvbatch (a job folder on shared
    storage: the system temp dir's kvbatch-offload, as scratch must be node-local).

    The fallback keeps the scratch on the job folder's disk and goes away with the job folder; for
    KV offload, point the variable (or `cache.offload_root`) at a node-local NVMe folder such as
    /mnt/nvme/kvbatch.
    """
    configured = os.environ.get(OFFLOAD_ROOT_ENV, "").strip()
    if configured:
        return Path(configured)
    job = Location.of(job_dir)
    return job.local_path / "scratch" / "kvbatch" if job.is_local else Path(tempfile.gettempdir()) / "kvbatch-offload"


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


def ensure_offload_root(offload_root: Path) -> Path:
    """Create (or adopt, when empty) the root and its marker; refuse '/' and foreign folders."""
    root = _check_not_filesystem_root(offload_root)
    root.mkdir(parents=True, exist_ok=True)
    marker = root / ROOT_MARKER
    if not marker.is_file():
        # another worker may have just marked the root and started a task: re-check before refusing
        if any(entry.name != ROOT_MARKER for entry in os.scandir(root)) and not marker.is_file():
            raise _not_a_kvbatch_root(offload_root)
        marker.write_text(f"kvbatch offload root, created {time.ctime()} on {socket.gethostname()}\n")
    return root


def _check_name(kind: str, value: str) -> None:
    if not _SAFE_NAME.fullmatch(value):
        raise ScratchError(
            f"{kind} {value!r} cannot name a scratch dir: use letters, digits, '_', '-' and '.' "
            f"(not first), at most 200 characters"
        )


def _write_owner_file(task_dir: Path, job_id: str) -> None:
    record = {**ProcessOwner.current().to_dict(), "job_id": job_id, "created": time.time()}
    temp = task_dir / f"{OWNER_FILE}.tmp"
    temp.write_text(json.dumps(record))
    os.rename(temp, task_dir / OWNER_FILE)  # a sweeper sees the whole record or none


def _make_task_dir(job_dir: Path, task_dir: Path) -> None:
    for _ in range(10):  # a concurrent task end may remove the empty job dir between our two mkdirs
        job_dir.mkdir(exist_ok=True)
        try:
            task_dir.mkdir()
            return
        except FileNotFoundError:
            continue
        except FileExistsError:
            raise ScratchError(
                f"scratch dir {task_dir} already exists: another process runs this task attempt, or a "
                f"crashed one left it (run `kvbatch clean` to remove dirs whose owner is gone)"
            ) from None
    raise ScratchError(f"could not create scratch dir {task_dir}: its job folder kept disappearing")


@contextmanager
def task_scratch(offload_root: Path, job_id: str, task_id: str, attempt: int) -> Iterator[Path]:
    """A fresh dir for one task attempt, removed when the block ends however it ends."""
    _check_name("job id", job_id)
    _check_name("task id", task_id)
    if attempt < 0:
        raise ScratchError(f"attempt must be >= 0, got {attempt} for task {task_id}")
    root = ensure_offload_root(offload_root)
    job_dir = root / job_id
    task_dir = job_dir / f"{task_id}.{attempt}"
    _make_task_dir(job_dir, task_dir)
    try:
        _write_owner_file(task_dir, job_id)
        yield task_dir
    finally:
        shutil.rmtree(task_dir, ignore_errors=True)
        try:
            job_dir.rmdir()  # only succeeds when this was the job's last task dir
        except OSError:
            pass


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path, followlinks=False):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _orphan_reason(task_dir: Path) -> tuple[str, str] | None:
    """(owner, reason) when the dir's owner is gone, None when it is (or may be) alive."""
    try:
        owner = ProcessOwner.from_dict(json.loads((task_dir / OWNER_FILE).read_text()))
    except (OSError, ValueError):
        try:
            age = time.time() - task_dir.lstat().st_mtime
        except FileNotFoundError:  # removed by its owner meanwhile
            return None
        if age < OWNERLESS_GRACE_S:
            return None
        return "unknown", f"no readable owner file for {age:.0f} s"
    liveness = owner.liveness()
    if liveness in (OwnerLiveness.ALIVE, OwnerLiveness.OTHER_HOST):
        return None
    return owner.describe(), f"owner process {liveness.value}"


def _real_subdirs(folder: Path) -> Iterator[os.DirEntry]:
    """Subdirectories that are not symlinks (which are never followed or removed)."""
    with os.scandir(folder) as entries:
        yield from [entry for entry in entries if entry.is_dir(follow_symlinks=False)]


def sweep_orphans(offload_root: Path, job_id: str | None = None) -> list[SweptDir]:
    """Remove task dirs (of every job, or just `job_id`) whose owner process on this host is gone."""
    root = _check_not_filesystem_root(offload_root)
    if not root.exists():
        return []
    if not (root / ROOT_MARKER).is_file():
        raise _not_a_kvbatch_root(offload_root)
    swept: list[SweptDir] = []
    for job_entry in _real_subdirs(root):
        if job_id is not None and job_entry.name != job_id:
            continue
        job_dir = Path(job_entry.path)
        for task_entry in _real_subdirs(job_dir):
            task_dir = Path(task_entry.path)
            if not _TASK_DIR_NAME.fullmatch(task_entry.name):
                continue
            orphan = _orphan_reason(task_dir)
            if orphan is None:
                continue
            size = _tree_bytes(task_dir)
            shutil.rmtree(task_dir, ignore_errors=True)
            swept.append(SweptDir(task_dir, job_entry.name, orphan[0], orphan[1], size))
        try:
            job_dir.rmdir()
        except OSError:
            pass
    return swept


def check_free_space(offload_root: Path, needed_bytes: int) -> int:
    """Raise ScratchSpaceError unless `needed_bytes` fit on the root's filesystem with a reserve.

    Returns the free bytes. `needed_bytes` should already be the caller's planned size (compressed
    estimate plus its own margin); the reserve keeps the filesystem itself from filling up.
    """
    probe = Path(offload_root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    reserve = min(RESERVE_BYTES_MAX, int(usage.total * RESERVE_FRACTION))
    if needed_bytes + reserve > usage.free:
        raise ScratchSpaceError(
            f"offload root {offload_root} has {usage.free / 2**20:.1f} MiB free; the task needs "
            f"{needed_bytes / 2**20:.1f} MiB plus a {reserve / 2**20:.1f} MiB reserve. Use a shorter "
            f"context or point cache.offload_root at a larger disk",
            free_bytes=usage.free,
            needed_bytes=needed_bytes,
        )
    return usage.free
