"""Who owns a lock or a scratch dir: host, pid and when the process started, in a clock-free form.

Pids are reused, so host + pid + start names one process, and a stale lock or orphaned scratch dir can be
reclaimed without touching a live owner's. The start is the kernel's ticks since boot within one boot_id,
which a wall-clock step does not move, unlike psutil's `create_time` (docs/cluster.md, "Offload
directories"). `start_time` (wall clock) is kept for people and for records written without /proc.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil

#: For records without clock ticks only: psutil's start times are 1/100 s; two readings agree within this.
_START_TIME_TOLERANCE_S = 0.05
_PROC = Path("/proc")


class OwnerLiveness(StrEnum):
    ALIVE = "alive"
    DEAD = "dead"  # no process with that pid on this host (or the host rebooted since)
    PID_REUSED = "pid reused"  # the pid now belongs to a process started at another time
    OTHER_HOST = "other host"  # cannot be checked from here: treated as alive by every caller


def boot_id() -> str | None:
    """This boot's random id (Linux); None where the kernel does not offer one."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and ')'); None without that process."""
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(b")") + 2:].decode().split()


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot; None when it does not exist or /proc is absent."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of the line; fields[0] is field 3 (state)


@dataclass(frozen=True)
class ProcessOwner:
    host: str
    pid: int
    start_time: float = field(compare=False)  # wall clock, moves with clock steps: for messages
    start_ticks: int | None = None
    boot_id: str | None = None

    @classmethod
    def current(cls) -> ProcessOwner:
        return cls.of_pid(psutil.Process().pid)

    @classmethod
    def of_pid(cls, pid: int) -> ProcessOwner:
        started = psutil.Process(pid).create_time()
        ticks = start_ticks(pid)
        return cls(host=socket.gethostname(), pid=pid, start_time=started, start_ticks=ticks,
                   boot_id=boot_id() if ticks is not None else None)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessOwner:
        """Parse the fields written by `to_dict`; raises ValueError naming what is missing or wrong."""
        try:
            ticks, boot = data.get("start_ticks"), data.get("boot_id")
            return cls(
                host=str(data["host"]), pid=int(data["pid"]), start_time=float(data["start_time"]),
                start_ticks=None if ticks is None else int(ticks), boot_id=None if boot is None else str(boot),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"owner record needs host, pid and start_time, got {data!r}") from exc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def liveness(self) -> OwnerLiveness:
        if self.host != socket.gethostname():
            return OwnerLiveness.OTHER_HOST
        current_boot = boot_id()
        if self.start_ticks is not None and self.boot_id is not None and current_boot is not None:
            if self.boot_id != current_boot:  # every process of an earlier boot is gone
                return OwnerLiveness.DEAD
            fields = _stat_fields(self.pid)
            if fields is None or fields[0] in ("Z", "X"):  # zombie: killed, not yet reaped by its parent
                return OwnerLiveness.DEAD
            return OwnerLiveness.ALIVE if int(fields[19]) == self.start_ticks else OwnerLiveness.PID_REUSED
        # a record written without ticks (older kvbatch, no /proc): a clock step can fool this
        try:
            process = psutil.Process(self.pid)
            started = process.create_time()
            if process.status() == psutil.STATUS_ZOMBIE:
                return OwnerLiveness.DEAD
        except psutil.NoSuchProcess:
            return OwnerLiveness.DEAD
        reused = abs(started - self.start_time) > _START_TIME_TOLERANCE_S
        return OwnerLiveness.PID_REUSED if reused else OwnerLiveness.ALIVE

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"
