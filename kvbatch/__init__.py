"""kvbatch from Python: run a batch, continue it, read its summaries in the order the documents were given.

A thin front to what `kvbatch submit`, `resume` and `results` run (runner/submit.py, storage/export.py):
the same checks, the same coordinator, the same job folder, so a job started here is resumed, watched
and exported by the CLI as well, and the other way round. Call it from the main thread: like the CLI,
it stops cleanly on Ctrl-C and SIGTERM, and Python only lets the main thread set signal handlers.

    import kvbatch
    job = kvbatch.submit([{"id": "memo", "text": "The board approved ..."}], job_dir="runs/memos")
    for row in kvbatch.results(job.job_dir):
        print(row["doc_id"], row["status"], row["summary"])

Bad input raises what the CLI reports in one line (ConfigError and ManifestError are ValueErrors,
JobDirError a RuntimeError, StorageError an OSError); how a run ended is `Job.exit_code`, the CLI's.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from jobs.uris import is_uri
from runner import __version__
from runner import submit as runner_submit
from storage.export import result_rows

__all__ = ["Job", "__version__", "results", "resume", "submit"]

#: exit codes that mean every document reached an end (3: some of them failed or were rejected)
_FINISHED = (0, 3)


@dataclass(frozen=True)
class Job:
    """A batch that ran: its folder and how it ended."""

    job_dir: str
    exit_code: int  # the CLI's: 0 all done, 3 some failed or rejected, 4/6/130 stopped early (resume it), ...

    @property
    def finished(self) -> bool:
        """Every document has ended, done, failed or rejected (exit 3 when any is not done); otherwise
        `resume(job_dir)` runs the rest."""
        return self.exit_code in _FINISHED


def submit(documents: str | os.PathLike[str] | Iterable[Mapping[str, Any]], *, job_dir: str | os.PathLike[str],
           config: str | os.PathLike[str] | None = None, settings: Mapping[str, Any] | None = None,
           address: str | None = None, glob: str | None = None, strict: bool = False,
           quiet: bool = False) -> Job:
    """Summarises `documents` into the new job folder `job_dir` and returns once the batch ended.

    `documents` is what `kvbatch submit` takes (a manifest, a folder of documents, an s3:// prefix) or
    the manifest's rows themselves: dicts with an `id` and a `text` or a `path` (relative to the
    working directory), optional `max_new_tokens`, `prompt` and metadata. `settings` are `--set`
    keys (`{"summarize.max_new_tokens": 64}`); `quiet` keeps the progress lines off stderr.
    """
    if isinstance(documents, (str, os.PathLike)):
        return _submit(str(documents), job_dir, config, settings, address, glob, strict, quiet)
    with tempfile.TemporaryDirectory(prefix="kvbatch-documents-") as folder:
        manifest = Path(folder) / "documents.jsonl"
        manifest.write_text("".join(json.dumps(_absolute(row), ensure_ascii=False) + "\n" for row in documents),
                            encoding="utf-8")
        return _submit(str(manifest), job_dir, config, settings, address, glob, strict, quiet)


def resume(job_dir: str | os.PathLike[str], *, retry_failed: bool = False, settings: Mapping[str, Any] | None = None,
           address: str | None = None, quiet: bool = False) -> Job:
    """Runs what a job has not finished (after Ctrl-C, a crash, a full disk); `retry_failed`: its failures too."""
    code = runner_submit.resume(str(job_dir), retry_failed, _overrides(settings), address, _console(quiet))
    return Job(str(job_dir), code)


def results(job_dir: str | os.PathLike[str], *, errors_only: bool = False,
            with_text: bool = False) -> list[dict[str, Any]]:
    """One row per document, in the order they were given, as `kvbatch results` writes them (docs/results.md)."""
    return result_rows(str(job_dir), errors_only, with_text)


def _submit(source: str, job_dir: str | os.PathLike[str], config: str | os.PathLike[str] | None,
            settings: Mapping[str, Any] | None, address: str | None, glob: str | None, strict: bool,
            quiet: bool) -> Job:
    config_path = Path(config) if config is not None else None
    code = runner_submit.submit(source, glob, config_path, str(job_dir), _overrides(settings), address, strict,
                                _console(quiet))
    return Job(str(job_dir), code)


def _overrides(settings: Mapping[str, Any] | None) -> list[str]:
    """`--set key=value` from a dict: each value as JSON, which the YAML the CLI reads takes as it is."""
    return [f"{key}={json.dumps(value)}" for key, value in (settings or {}).items()]


def _absolute(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row whose relative `path` is taken from the working directory, not the temporary manifest's."""
    path = row.get("path")
    if isinstance(path, str) and not is_uri(path) and not os.path.isabs(path):
        return {**row, "path": os.path.abspath(path)}
    return dict(row)


def _console(quiet: bool) -> Console:
    return Console(stderr=True, quiet=quiet, soft_wrap=True)
