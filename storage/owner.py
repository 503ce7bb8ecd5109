"""Who owns a lock or a scratch dir: host, pid and process start time.

A pid alone is not an identity: pids are reused, so a dead owner's pid may belong to an unrelated
process later. Host + pid + start time identifies one process for its whole life, which is what
lets a stale lock or an orphaned scratch dir be reclaimed without ever touching a live owner's.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import psutil

#: psutil derives start times from clock ticks (1/100 s); two readings of one process agree within this.
_START_TIME_TOLERANCE_S = 0.05


class OwnerLiveness(StrEnum):
    ALIVE = "alive"
    DEAD = "dead"  # no process with that pid on this host
    PID_REUSED = "pid reused"  # the pid now belongs to a process started at another time
    OTHER_HOST = "other host"  # cannot be checked from here: treated as alive by every caller


@dataclass(frozen=True)
class ProcessOwner:
    host: str
    pid: int
    start_time: float

    @classmethod
    def current(cls) -> ProcessOwner:
        return cls.of_pid(psutil.Process().pid)

    @classmethod
    def of_pid(cls, pid: int) -> ProcessOwner:
        return cls(host=socket.gethostname(), pid=pid, start_time=psutil.Process(pid).create_time())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessOwner:
        """Parse the fields written by `to_dict`; raises ValueError naming what is missing or wrong."""
        try:
            return cls(host=str(data["host"]), pid=int(data["pid"]), start_time=float(data["start_time"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"owner record needs host, pid and start_time, got {data!r}") from exc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def liveness(self) -> OwnerLiveness:
        if self.host != socket.gethostname():
            return OwnerLiveness.OTHER_HOST
        try:
            process = psutil.Process(self.pid)
            started = process.create_time()
            if process.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped by its parent
                return OwnerLiveness.DEAD
        except psutil.NoSuchProcess:
            return OwnerLiveness.DEAD
        if abs(started - self.start_time) > _START_TIME_TOLERANCE_S:
            return OwnerLiveness.PID_REUSED
        return OwnerLiveness.ALIVE

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"
