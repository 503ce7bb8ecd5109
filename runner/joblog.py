"""job.log: one JSON object a line, so operators can grep and tools can parse the same file."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        return json.dumps(entry, default=str)


class JobLog:
    """Appends events to JOB_DIR/job.log; warnings are echoed to the console by the caller."""

    def __init__(self, path: Path) -> None:
        self._logger = logging.getLogger(f"kvbatch.job.{path}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(path, encoding="utf-8")
        self._handler.setFormatter(_JsonLines())
        self._logger.addHandler(self._handler)

    def info(self, event: str, **fields: Any) -> None:
        self._logger.info(event, extra={"fields": fields})

    def warning(self, event: str, **fields: Any) -> None:
        self._logger.warning(event, extra={"fields": fields})

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every parseable line of a job.log (a line torn by a crash is skipped)."""
    entries = []
    if not path.exists():
        return entries
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries

