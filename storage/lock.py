"""JOB_DIR/.lock: one coordinator per job folder (docs/cluster.md, "Crashes, retries and fallbacks").

Exclusion is a flock, which the kernel drops however the holder dies, so no dead process holds it; the
record (host, pid, process start) names the holder in messages. Where flock is a no-op, a record whose
owner is verifiably alive on this host is respected even when the flock was granted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from contextlib import suppress

from storage.location import Location, Where
from storage.owner import OwnerLiveness, ProcessOwner

logger = logging.getLogger(__name__)


class JobLockedError(RuntimeError):
    """Another live coordinator holds the job folder."""


def parse_owner(raw: bytes) -> ProcessOwner | None:
    try:
        return ProcessOwner.from_dict(json.loads(raw))
    except ValueError:  # an empty, torn or foreign record names nobody; the flock is what counts
        return None


def record_expiry(raw: bytes) -> float | None:
    """The wall-clock expiry a lease record states, for people: no lease decision compares it."""
    try:
        return float(json.loads(raw)["expires"])
    except (ValueError, KeyError, TypeError):
        return None


def lock_holder(path: Where) -> ProcessOwner | None:
    """Who the lock record names, read without touching the lock (for `status`); nobody for an expired lease."""
    try:
        raw = Location.of(path).read_bytes()
    except OSError:
        return None
    expires = record_expiry(raw)
    return None if expires is not None and expires < time.time() else parse_owner(raw)


class HeldLock(ABC):
    """What every job lock shares: messages, context manager; `takeover_message` names a replaced stale lock."""

    takeover_message: str | None = None

    def __init__(self, path: Where) -> None:
        self.location = Location.of(path)

    @abstractmethod
    def acquire(self) -> None:
        """Take the lock or raise JobLockedError naming the holder."""

    @abstractmethod
    def release(self) -> None:
        """Give the lock up (nothing to do when it is not held)."""

    @property
    def lost(self) -> str | None:
        """Why the lock was lost while held, or None (a lease can be lost; a flock cannot)."""
        return None

    def check(self) -> None:
        """The fence: every publish into the job folder calls this first; raises once the lock is lost."""

    def _refusal(self, holder: ProcessOwner | None, expires: float | None = None) -> str:
        """Why the lock cannot be taken, naming its holder only as running when it is: a record may name a
        process that is gone (a lease a killed coordinator left, whose TTL has not run out)."""
        folder = self.location.parent
        if holder is not None and holder.liveness() in (OwnerLiveness.DEAD, OwnerLiveness.PID_REUSED):
            gone = f"its lock names {holder.describe()}, which is no longer running"
            if expires is not None:
                left = max(0.0, expires - time.time())
                at = time.strftime("%H:%M:%S", time.localtime(expires))
                return (f"job folder {folder} is locked: {gone}; its lease expires at {at} (in {left:.0f} s), "
                        f"run the command again then")
            return (f"job folder {folder} is locked by another process ({gone}); wait for that process to end, "
                    f"then run the command again")
        who = holder.describe() if holder else "another process"
        return (
            f"job folder {folder} is in use by a running coordinator ({who}); "
            f"wait for it to finish or stop it, then run the command again"
        )

    def _takeover(self, previous: ProcessOwner, why: str | None = None) -> str:
        why = why or {
            OwnerLiveness.PID_REUSED: "its pid now belongs to another process",
            OwnerLiveness.OTHER_HOST: "its lock is no longer held",
        }.get(previous.liveness(), "its process is gone")
        return f"took over stale lock {self.location} left by {previous.describe()}: {why}"

    def __enter__(self) -> HeldLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class JobLock(HeldLock):
    """A local job folder's lock file (JOB_DIR/.lock), held with flock."""

    def __init__(self, path: Where) -> None:
        super().__init__(path)
        self.path = self.location.local_path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise JobLockedError naming the holder."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this JobLock")
        fd = self._open_locked()
        try:
            previous = parse_owner(os.pread(fd, 65536, 0))  # a record is a few hundred bytes
            me = ProcessOwner.current()
            if previous is not None and previous != me and previous.liveness() == OwnerLiveness.ALIVE:
                raise JobLockedError(self._refusal(previous))
            self.takeover_message = self._takeover(previous) if previous not in (None, me) else None
            record = json.dumps({**me.to_dict(), "locked_at": time.time()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        if self.takeover_message:
            logger.warning(self.takeover_message)

    def _open_locked(self) -> int:
        """An fd with the flock held on the file currently at `path` (not one a releaser just unlinked)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = parse_owner(os.pread(fd, 65536, 0))
                os.close(fd)
                raise JobLockedError(self._refusal(holder)) from None
            with suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the record and drop the flock; the unlink happens while still holding it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)
