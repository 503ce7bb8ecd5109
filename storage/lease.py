"""The job lock on object storage: a lease object written only under a condition, and kept renewed.

Object stores have no flock, so the lease is created with `If-None-Match: *` and rewritten only with
`If-Match` of the version its writer last saw; no clocks are compared across machines (docs/cluster.md,
"The lease"). The holder times its lease on CLOCK_BOOTTIME (which runs through a suspend), and every
publish first calls `check()`, the fence, which raises LeaseLostError before any taker can start.
A storage error is never "no lease".
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time

from storage.location import Location, Where, storage_error
from storage.lock import HeldLock, JobLock, JobLockedError, parse_owner, record_expiry
from storage.owner import OwnerLiveness, ProcessOwner

logger = logging.getLogger(__name__)

LEASE_TTL_S = 60.0
"""How long a lease outlives a coordinator that stopped renewing it (killed, paused, its machine lost)."""
LEASE_TTL_ENV = "KVBATCH_LEASE_TTL_S"
#: A holder renews this often (in TTLs): several tries fit in its validity.
_RENEW_EVERY = 0.2
#: A holder's lease is valid this long (in TTLs) after it sent its last renewal: a margin for clock-rate drift.
_VALID_FOR = 0.8
_READ_TRIES = 5


class LeaseLostError(JobLockedError):
    """This coordinator no longer holds the job lease: another one took it over."""


class LeaseStorageError(OSError):
    """The lease object could not be read or written (not a refusal: the store did not answer)."""


def _clock() -> float:
    """Seconds on a clock no wall-clock step moves and that keeps counting through a suspend."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


def job_lock(path: Where, ttl_s: float | None = None) -> HeldLock:
    """The lock kind the job folder's storage supports: flock on a local disk, a lease on S3."""
    location = Location.of(path)
    if location.is_local:
        return JobLock(location)
    if ttl_s is None:
        ttl_s = float(os.environ.get(LEASE_TTL_ENV) or LEASE_TTL_S)
    return JobLease(location, ttl_s)


class _S3Object:
    """One S3 object that is only ever written under a condition (boto3: pyarrow sends no If-Match)."""

    def __init__(self, location: Location) -> None:
        import boto3
        from botocore.config import Config

        if not location.uri.startswith("s3://"):
            raise JobLockedError(
                f"{location.parent} cannot be locked: a job folder on object storage needs conditional "
                f"writes (If-None-Match / If-Match), which kvbatch uses on s3:// only. Use an s3:// URI "
                f"(any S3-compatible store), or a local or NFS folder"
            )
        self.uri = location.uri
        self.bucket, self.key = location.path.split("/", 1)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        region = getattr(location.fs, "region", None) or None
        self._client = boto3.client(
            "s3", endpoint_url=endpoint, region_name=region,
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=15),
        )

    def _call(self, action: str, method: str, **arguments: str | bytes) -> dict | None:
        """The client's answer; None when the store refused: the condition failed (412), a concurrent conditional
        write won (409) or no object (404, but a missing bucket is an error). Other errors name the URI and fix."""
        from botocore.exceptions import ClientError

        try:
            return getattr(self._client, method)(Bucket=self.bucket, Key=self.key, **arguments)
        except Exception as exc:  # noqa: BLE001 - botocore raises several unrelated types
            if (isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") != "NoSuchBucket"
                    and exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (404, 409, 412)):
                return None
            raise storage_error(self.uri, exc) or LeaseStorageError(
                f"could not {action} the job lease {self.uri}: {type(exc).__name__}: {exc}") from None

    def create(self, body: bytes) -> str | None:
        """The new version's ETag, or None when the object exists."""
        answer = self._call("write", "put_object", Body=body, IfNoneMatch="*")
        return None if answer is None else answer["ETag"]

    def replace(self, body: bytes, etag: str) -> str | None:
        """The new version's ETag, or None when the object is no longer version `etag`."""
        answer = self._call("write", "put_object", Body=body, IfMatch=etag)
        return None if answer is None else answer["ETag"]

    def read(self) -> tuple[bytes, str] | None:
        """(content, ETag), or None when there is no lease object."""
        answer = self._call("read", "get_object")
        return None if answer is None else (answer["Body"].read(), answer["ETag"])

    def etag(self) -> str | None:
        answer = self._call("read", "head_object")
        return None if answer is None else answer["ETag"]

    def delete(self, etag: str) -> None:
        """Remove version `etag` (nothing happens when the object has changed since)."""
        self._call("remove", "delete_object", IfMatch=etag)


class JobLease(HeldLock):
    def __init__(self, path: Where, ttl_s: float = LEASE_TTL_S) -> None:
        super().__init__(path)
        if ttl_s <= 0:
            raise ValueError(f"a lease TTL must be > 0 s, got {ttl_s}")
        self.ttl_s = ttl_s
        self._store = _S3Object(self.location)
        self._token = secrets.token_hex(8)
        self._seq = 0
        self._etag: str | None = None
        self._valid_until = 0.0
        self._lost: str | None = None  # why, once lost
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self._renewer: threading.Thread | None = None

    def _record(self) -> bytes:
        self._seq += 1
        now = time.time()
        return json.dumps({
            **ProcessOwner.current().to_dict(), "token": self._token, "seq": self._seq, "ttl_s": self.ttl_s,
            # wall-clock times are for people and `status`; no decision compares them
            "renewed_at": now, "expires": now + self.ttl_s,
        }).encode()

    def _took(self, etag: str, sent: float) -> None:
        self._etag = etag
        self._valid_until = sent + self.ttl_s * _VALID_FOR

    def _read(self) -> tuple[bytes, str] | None:
        """The lease's content and version; retried, and a persistent error raised, never 'no lease'."""
        for attempt in range(_READ_TRIES - 1):
            try:
                return self._store.read()
            except LeaseStorageError:
                time.sleep(min(2.0, 0.1 * 2**attempt))
        return self._store.read()

    def _watch(self, etag: str, ttl_s: float) -> str:
        """Watch version `etag` for a full TTL on this machine's clock: 'changed', 'gone' or 'still'."""
        deadline = _clock() + ttl_s
        poll_s = min(2.0, max(0.05, ttl_s / 20))
        while (left := deadline - _clock()) > 0:
            time.sleep(min(poll_s, left))
            try:
                now = self._store.etag()
            except LeaseStorageError:
                continue  # the takeover below is conditional on `etag`: a missed look cannot mislead it
            if now is None:
                return "gone"
            if now != etag:
                return "changed"
        return "still"

    def acquire(self) -> None:
        """Take the lease or raise JobLockedError naming the holder (an unreadable store is never 'free')."""
        for _ in range(10):
            sent = _clock()
            created = self._store.create(self._record())
            if created is not None:
                self._took(created, sent)
                break
            if (current := self._read()) is None:
                continue  # released between our create and our read: try again
            raw, etag = current
            holder = parse_owner(raw)
            try:
                ttl_s = float(json.loads(raw).get("ttl_s") or self.ttl_s)
            except (ValueError, AttributeError, TypeError):
                ttl_s = self.ttl_s
            liveness = holder.liveness() if holder else None
            if liveness == OwnerLiveness.ALIVE:
                raise JobLockedError(self._refusal(holder))
            why = None
            if liveness not in (OwnerLiveness.DEAD, OwnerLiveness.PID_REUSED):
                logger.warning("job lease %s is held by %s: waiting up to %.0f s for it to be renewed",
                               self.location, holder.describe() if holder else "an unreadable record", ttl_s)
                seen = self._watch(etag, ttl_s)
                if seen == "gone":
                    continue
                if seen == "changed":
                    raise JobLockedError(self._refusal_now(holder))
                why = f"its lease expired (not renewed for {ttl_s:g} s)"
            sent = _clock()
            taken = self._store.replace(self._record(), etag)
            if taken is None:  # renewed, released or taken by another taker meanwhile: judge who holds it now
                continue
            self._took(taken, sent)
            self.takeover_message = (
                self._takeover(holder, why) if holder else f"took over lease {self.location} of an unreadable record"
            )
            logger.warning(self.takeover_message)
            break
        else:
            raise JobLockedError(f"{self._refusal(None)} (its lease keeps appearing and disappearing)")
        self._renewer = threading.Thread(target=self._renew, name="job-lease", daemon=True)
        self._renewer.start()

    def _refusal_now(self, watched: ProcessOwner | None) -> str:
        """The refusal naming whom the lease names now: while this taker watched, another may have taken it."""
        if (current := self._read()) is None:
            return self._refusal(None)
        holder = parse_owner(current[0])
        if holder is not None and holder == watched:
            return self._refusal(holder) + " (it keeps renewing its lease)"
        return self._refusal(holder, record_expiry(current[0])) + " (it took the lease over while this one waited)"

    def _lose(self, why: str) -> None:
        with self._guard:
            if self._lost is None:
                self._lost = why
                logger.error("lost the job lease %s: %s", self.location, why)

    def _renew(self) -> None:
        interval = self.ttl_s * _RENEW_EVERY
        while not self._stop.wait(interval):
            sent = _clock()
            if self.lost is not None:  # refused, or paused or cut off longer than our validity: a taker may hold it
                return
            etag = self._etag  # only this thread changes it while the lease is held
            try:
                renewed = self._store.replace(self._record(), etag)
            except LeaseStorageError:
                logger.warning("could not renew the job lease %s; trying again", self.location, exc_info=True)
                interval = self.ttl_s * _RENEW_EVERY / 4
                continue
            interval = self.ttl_s * _RENEW_EVERY
            if renewed is None:
                self._lose("another coordinator took it over")
                return
            with self._guard:
                self._took(renewed, sent)

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None while it is held."""
        if self._lost is None and self._renewer is not None and _clock() > self._valid_until:
            self._lose(f"no renewal for over {self.ttl_s * _VALID_FOR:.0f} s (this process was paused or "
                       f"could not reach the store)")
        return self._lost

    def check(self) -> None:
        if (why := self.lost) is not None:
            raise LeaseLostError(
                f"this coordinator lost the job lease of {self.location.parent} ({why}); it wrote nothing "
                f"since. Another coordinator runs the job now: check with `kvbatch status {self.location.parent}`, "
                f"and run `kvbatch resume {self.location.parent}` if it is no longer running"
            )

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this version (never a taker's)."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        if self._lost is None and self._etag is not None:
            self._store.delete(self._etag)
