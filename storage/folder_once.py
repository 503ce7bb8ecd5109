"""A folder built once per machine and published whole: safe when many processes want it at once.

`dest` only appears by an atomic rename of a finished, fsynced temp folder, so if it exists it is
complete. Builders take turns under a flock beside it (dropped when a holder dies): the second finds
`dest` and skips the work, and the next holder removes temp folders a killed builder left.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from storage.location import fsync_directory

Announce = Callable[[str], None]
"""Tells people what is being built or waited for (a build can take tens of seconds)."""


def build_folder_once(dest: Path, build: Callable[[Path], None], message: str, announce: Announce) -> Path:
    """`dest`, built by `build(temp_folder)` (announcing `message`) first if it is not there yet."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = dest.parent / f".{dest.name}.lock"
    with open(lock, "a+b") as handle:  # closing it releases the lock
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            announce(f"waiting for another process that is preparing {dest.name} (lock {lock})...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        if dest.is_dir():
            return dest
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            announce(message)
            started = time.perf_counter()
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the folder is shared by every user's processes
            for path in tmp.rglob("*"):
                if path.is_file():
                    with open(path, "rb") as handle:
                        os.fsync(handle.fileno())
            fsync_directory(tmp)
            os.rename(tmp, dest)
            fsync_directory(dest.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        announce(f"done in {time.perf_counter() - started:.1f} s: {dest}")
    return dest
