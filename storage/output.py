"""Files the user names with `-o`: written where the name points, whole or not at all.

A symlink, FIFO, device or one of this process's descriptors is written into as it is (docs/design.md,
"Command line"). Any other file goes through a random, exclusively created temporary beside it (so never
through a symlink planted in a shared folder), fsynced and renamed over it: a full disk leaves no truncated
file.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

from storage.location import Location, StorageError

#: `-o -`: standard output (the commands that take it say so).
STDOUT = "-"

_DESCRIPTOR_NAMES = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PATH = re.compile(r"/dev/fd/(\d+)|/proc/(?:self|thread-self|(\d+))/fd/(\d+)")
#: the temporary file is created exclusively (an existing name, a symlink too, is an error), never through a link
_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_TEMP_TRIES = 100


def output_error(path: Path | Location | str, error: OSError) -> StorageError:
    """An output file named by -o that cannot be written: one line naming it and what to do."""
    return StorageError(
        f"cannot write {path} ({error.strerror or error}): give -o a file in a folder that exists and that you can write to"
    )


def descriptor_of(path: Path | str) -> int | None:
    """The open descriptor of this process that `path` names (`/dev/stdout`: 1, `/dev/fd/3`: 3,
    `/proc/self/fd/1`: 1), or None for any other path. Named by its spelling: opening such a name
    again would not reach a pipe (its /proc link names no file) and would truncate a file."""
    text = os.path.normpath(os.path.abspath(os.fspath(path)))
    if text in _DESCRIPTOR_NAMES:
        return _DESCRIPTOR_NAMES[text]
    if (match := _DESCRIPTOR_PATH.fullmatch(text)) is None:
        return None
    fd_dev, pid, fd_proc = match.groups()
    if pid is not None and int(pid) != os.getpid():
        return None  # another process's descriptor: a path like any other
    return int(fd_dev if fd_dev is not None else fd_proc)


def write_output(path: Path | str, write: Callable[[BinaryIO], object]) -> None:
    """Writes what `write` puts into the handle it is given to the file `path` names (see the module)."""
    if (fd := descriptor_of(path)) is not None:
        write_descriptor(path, fd, write)
        return
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


def write_descriptor(name: Path | str, fd: int, write: Callable[[BinaryIO], object]) -> None:
    """Writes into the already open descriptor `fd` (through a copy of it, so it stays open): its file
    keeps its inode, its position and its O_APPEND; what Python buffered for stdout or stderr goes first."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a stream with no descriptor (a captured one) or a closed one
            if stream is not None and stream.fileno() == fd:
                stream.flush()
    try:
        with os.fdopen(os.dup(fd), "wb") as handle:
            write(handle)
    except OSError as e:
        raise output_error(name, e) from None


def _open_temp(target: Path) -> tuple[int, Path]:
    """A new file beside `target` under a random hidden name, created exclusively: a name that is
    taken (by a symlink someone planted in a shared folder, say) is never opened, another is drawn."""
    for _ in range(_TEMP_TRIES):
        temp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            # 0o666 less the umask, as open() makes a new file; an existing file keeps its own permissions
            return os.open(temp, _EXCLUSIVE, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside it after {_TEMP_TRIES} tries")


def _replace(target: Path, write: Callable[[BinaryIO], object], mode: int | None) -> None:
    """Write a temporary file beside `target`, then rename it over `target`; on any failure remove it."""
    fd, temp = _open_temp(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
