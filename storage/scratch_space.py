"""Room on an offload root's filesystem, shared fairly by the task dirs that write there at once.

Free space when a task starts says nothing of what its running neighbours will still write, so each task
dir records its claim and a new claim counts the live dirs' unwritten claims as taken (docs/design.md,
"Per-task scratch"). Claims are decided one at a time under a `flock` of the root's marker; one that fits
once live dirs are gone waits for them, so which task runs shorter does not depend on who wrote first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: Never plan to use the last of a filesystem: keep min(256 MiB, 5% of its size) free.
RESERVE_BYTES_MAX = 256 * 2**20
RESERVE_FRACTION = 0.05
POLL_S = 0.2


@dataclass(frozen=True)
class Claim:
    """A live task dir's hold on the disk: what it claimed when it began, what it holds now."""

    claimed_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class Room:
    """One look at the filesystem, the live claims on it and one more claim of `needed_bytes`."""

    free_bytes: int
    reserve_bytes: int
    needed_bytes: int
    claims: tuple[Claim, ...]

    @property
    def promised_bytes(self) -> int:
        """Claimed but not written yet: taken from the free space although no file holds it yet."""
        return sum(max(0, claim.claimed_bytes - claim.used_bytes) for claim in self.claims)

    @property
    def fits(self) -> bool:
        return self.needed_bytes + self.reserve_bytes + self.promised_bytes <= self.free_bytes

    @property
    def fits_once_claims_end(self) -> bool:
        """Whether it fits once every live claim has ended and its files are gone (worth waiting for)."""
        used = sum(claim.used_bytes for claim in self.claims)
        return self.needed_bytes + self.reserve_bytes <= self.free_bytes + used


@contextmanager
def room_claimed(root: Path, lock_file: Path, needed_bytes: int, wait_s: float,
                 live_claims: Callable[[], tuple[Claim, ...]], refuse: Callable[[Room], Exception]) -> Iterator[Room]:
    """Held, with `lock_file` (a file on the root) locked, while the caller records its claim, so no
    other claim is decided in between. Waits up to `wait_s` while live claims hold room they would leave
    when they end; raises `refuse(room)` then, or at once when it would not fit even without them."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            usage = shutil.disk_usage(root)
            reserve = min(RESERVE_BYTES_MAX, int(usage.total * RESERVE_FRACTION))
            room = Room(usage.free, reserve, needed_bytes, live_claims())
            if room.fits:
                yield room
                return
            if not room.fits_once_claims_end or time.monotonic() >= deadline:
                raise refuse(room)
        finally:
            os.close(fd)  # releases the lock
        time.sleep(POLL_S)
