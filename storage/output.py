"""Files the user names with `-o`: written where the name points, whole or not at all.

A symlink's target is written (the link stays a link); a FIFO, `/dev/null` or another character
device is written into as it is (replacing it would turn a device node or a pipe into a plain file);
a regular file, or a new one, is written to a temporary name beside its target, fsynced and renamed
over it, so a write that fails (a full disk) leaves the old file, or none, never a truncated one.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from storage.location import Location, StorageError


def output_error(path: Path | Location, error: OSError) -> StorageError:
    """An output file named by -o that cannot be written: one line naming it and what to do."""
    return StorageError(
        f"cannot write {path} ({error.strerror or error}): give -o a file in a folder that exists and that you can write to"
    )


def write_output(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Writes what `write` puts into the handle it is given to the file `path` names (see the module)."""
    target = Path(os.path.realpath(path))
    try:
        kind = os.stat(target).st_mode
    except FileNotFoundError:
        kind = None
    except OSError as e:
        raise output_error(path, e) from None
    try:
        if kind is not None and stat.S_ISDIR(kind):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if kind is not None and not stat.S_ISREG(kind):
            with open(target, "wb") as handle:  # a pipe or a device: streamed into, never replaced
                write(handle)
            return
        _replace(target, write, None if kind is None else stat.S_IMODE(kind))
    except OSError as e:
        raise output_error(path, e) from None


def _replace(target: Path, write: Callable[[BinaryIO], object], mode: int | None) -> None:
    """Write a temporary file beside `target`, then rename it over `target`; on any failure remove it."""
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # 0o666 less the umask, as open() makes a new file; an existing file keeps its own permissions
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temp, mode)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
