"""The job lock on shared object storage: a lease record the holder keeps renewing.

Object stores have no flock, so `.lock` holds the owner, a random token and an expiry time; the
coordinator rewrites it every `ttl_s / 3`. A record that expired, or whose owner is a dead process
on this host, is taken over. After writing its record a taker reads it back a moment later: when two
raced, the later write wins and the other backs off with the usual "in use" error.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time

from storage.location import Location, Where
from storage.lock import HeldLock, JobLock, JobLockedError, parse_owner
from storage.owner import OwnerLiveness, ProcessOwner

logger = logging.getLogger(__name__)

LEASE_TTL_S = 60.0
"""How long a record outlives a coordinator that stopped renewing it (killed, or its machine lost)."""
_SETTLE_S = 0.5
"""How long a taker waits before reading its record back, so a racing write has landed."""


def job_lock(path: Where, ttl_s: float = LEASE_TTL_S) -> HeldLock:
    """The lock kind the job folder's storage supports: flock on a local disk, a lease elsewhere."""
    location = Location.of(path)
    return JobLock(location) if location.is_local else JobLease(location, ttl_s)


class JobLease(HeldLock):
    def __init__(self, path: Where, ttl_s: float = LEASE_TTL_S) -> None:
        super().__init__(path)
        self.ttl_s = ttl_s
        self._token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _read(self) -> tuple[dict, ProcessOwner | None]:
        """The record and the owner it names (empty and None when there is none or it is torn)."""
        try:
            raw = self.location.read_bytes()
            return json.loads(raw), parse_owner(raw)
        except (OSError, ValueError):
            return {}, None

    def _write(self) -> None:
        record = {**ProcessOwner.current().to_dict(), "token": self._token, "expires": time.time() + self.ttl_s}
        self.location.write_bytes_atomic(json.dumps(record).encode(), f".lock.{self._token}.tmp")

    def acquire(self) -> None:
        """Take the lease or raise JobLockedError naming the holder."""
        record, previous = self._read()
        if previous is not None:
            expired = float(record.get("expires", 0)) < time.time()
            gone = previous.liveness() in (OwnerLiveness.DEAD, OwnerLiveness.PID_REUSED)
            if not expired and not gone:
                raise JobLockedError(self._refusal(previous) + f" (its lease runs until {time.ctime(record['expires'])})")
            why = "its lease expired" if expired else None
            self.takeover_message = self._takeover(previous, why)
        self._write()
        time.sleep(_SETTLE_S)
        mine, holder = self._read()
        if mine.get("token") != self._token:
            raise JobLockedError(self._refusal(holder))
        if self.takeover_message:
            logger.warning(self.takeover_message)
        self._renewer = threading.Thread(target=self._renew, name="job-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write()
            except OSError:  # storage hiccup: the next round tries again, well before expiry
                logger.warning("could not renew the job lease %s", self.location, exc_info=True)

    def release(self) -> None:
        """Stop renewing and remove the record if it is still ours."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        record, _ = self._read()
        if record.get("token") == self._token:
            self.location.delete()
