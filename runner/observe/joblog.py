"""job.log: one JSON object a line, so operators can grep and tools can parse the same file."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from storage.location import Fence, Location, Where, no_fence
from storage.lock import JobLockedError

OBJECT_LOG_UPLOAD_S = 5.0
"""On object storage (no appends) job.log is rewritten whole, at most this often and at close: a crash
loses at most the last few seconds."""


class JobLog:
    """Appends events to JOB_DIR/job.log; warnings are echoed to the console by the caller."""

    def __init__(self, path: Where, fence: Fence = no_fence) -> None:
        """`fence`: on object storage, called before each rewrite of the log (the job lock's check)."""
        self._location = Location.of(path)
        self._fence = fence
        self._lock = threading.Lock()
        self._file, self._text = None, ""
        if self._location.is_local:
            self._file = open(self._location.local_path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        elif self._location.exists():
            self._text = self._location.read_bytes().decode("utf-8", errors="replace")
        self._uploaded_at = 0.0
        self._dirty = self._closed = False

    def info(self, event: str, **fields: Any) -> None:
        self._write("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._write("warning", event, fields)

    def _write(self, level: str, event: str, fields: dict[str, Any]) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "level": level, "event": event, **fields}, default=str)
        with self._lock:
            if self._closed:
                return
            if self._file is not None:
                try:
                    self._file.write(line + "\n")
                    self._file.flush()
                except OSError:  # a full disk: dropped; the checkpoint's own write fails the same way and stops the job
                    pass
                return
            self._text += line + "\n"
            self._dirty = True
            if time.monotonic() - self._uploaded_at >= OBJECT_LOG_UPLOAD_S:
                self._upload()

    def _upload(self) -> None:
        try:
            self._location.write_bytes_atomic(self._text.encode(), fence=self._fence)
        except JobLockedError:  # the job lease was lost: the log is the new holder's to write now
            self._dirty = False
            return
        self._uploaded_at = time.monotonic()
        self._dirty = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
            elif self._dirty:
                self._upload()


def read_log(path: Where) -> list[dict[str, Any]]:
    """Every parseable line of a job.log (a line torn by a crash is skipped)."""
    location = Location.of(path)
    entries: list[dict[str, Any]] = []
    try:
        text = location.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return entries
    for line in text.splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries
