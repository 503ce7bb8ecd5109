"""job.log: one JSON object a line, so operators can grep and tools can parse the same file."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any

from storage.location import Fence, Location, Where, no_fence
from storage.lock import JobLockedError

OBJECT_LOG_UPLOAD_S = 5.0
"""On object storage (no appends) job.log is rewritten whole, at most this often and at close."""


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        return json.dumps(entry, default=str)


class _ObjectLogHandler(logging.Handler):
    """Keeps the log's lines and rewrites the object; a crash loses at most the last few seconds."""

    def __init__(self, location: Location, fence: Fence) -> None:
        super().__init__()
        self.location = location
        self.fence = fence
        self._text = location.read_bytes().decode("utf-8", errors="replace") if location.exists() else ""
        self._uploaded_at = 0.0
        self._dirty = False
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:
            self._text += self.format(record) + "\n"
            self._dirty = True
            if time.monotonic() - self._uploaded_at >= OBJECT_LOG_UPLOAD_S:
                self._upload()

    def _upload(self) -> None:
        try:
            self.location.write_bytes_atomic(self._text.encode(), f".job.log.{secrets.token_hex(4)}.tmp", self.fence)
        except JobLockedError:  # the job lease was lost: the log is the new holder's to write now
            self._dirty = False
            return
        self._uploaded_at = time.monotonic()
        self._dirty = False

    def close(self) -> None:
        with self._guard:
            if self._dirty:
                self._upload()
        super().close()


class _FileHandler(logging.FileHandler):
    """A line that cannot be written (a full disk) is dropped without a traceback on stderr: the
    checkpoint's own write fails the same way and stops the job with what to do."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


class JobLog:
    """Appends events to JOB_DIR/job.log; warnings are echoed to the console by the caller."""

    def __init__(self, path: Where, fence: Fence = no_fence) -> None:
        """`fence`: on object storage, called before each rewrite of the log (the job lock's check)."""
        location = Location.of(path)
        self._logger = logging.getLogger(f"kvbatch.job.{location}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler: logging.Handler = (
            _FileHandler(location.local_path, encoding="utf-8") if location.is_local
            else _ObjectLogHandler(location, fence)
        )
        self._handler.setFormatter(_JsonLines())
        self._logger.addHandler(self._handler)

    def info(self, event: str, **fields: Any) -> None:
        self._logger.info(event, extra={"fields": fields})

    def warning(self, event: str, **fields: Any) -> None:
        self._logger.warning(event, extra={"fields": fields})

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


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
