"""kvbatch from Python: run a batch, continue it, read its summaries in the order the documents were given.

A thin front to what `kvbatch submit`, `resume` and `results` run (runner/submit.py, storage/export.py):
the same checks, the same coordinator, the same job folder, so a job started here is resumed, watched
and exported by the CLI as well, and the other way round. Call it from the main thread: like the CLI,
it stops cleanly on Ctrl-C and SIGTERM, and Python only lets the main thread set signal handlers.

    import kvbatch
    job = kvbatch.submit([{"id": "memo", "text": "The board approved ..."}], job_dir="runs/memos")
    for row in kvbatch.results(job.job_dir):
        print(row["doc_id"], row["status"], row["summary"])
    print(kvbatch.status(job.job_dir)["counts"])  # what `kvbatch status --json` prints

Bad input raises what the CLI reports in one line (ConfigError and ManifestError are ValueErrors,
JobDirError a RuntimeError, StorageError an OSError): rows are read in memory by the manifest's own
rules, so a bad row is rejected alone, named by its place. How a run ended is `Job.exit_code`, the CLI's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from jobs.config import ConfigError, JobConfig, apply_settings, config_from_dict, read_config
from jobs.manifest import ManifestError
from runner import __version__
from runner import submit as runner_submit
from runner.observe.status import JobStatus, job_status
from storage.export import result_rows
from storage.jobdir import DEFAULT_JOBS_DIR, new_job_id

__all__ = ["BudgetedDynamicCache", "GrowingLayer", "Job", "JobConfig", "JobStatus", "KVBudgetExceeded", "TieredCache",
           "__version__", "read_config", "results", "resume", "status", "submit"]

_CACHES = ("BudgetedDynamicCache", "GrowingLayer", "KVBudgetExceeded", "TieredCache")
"""The caches for code that calls transformers itself (`kvbatch.TieredCache`), from runner/engine/kvcache:
imported on first use, so `import kvbatch` does not import torch."""


def __getattr__(name: str) -> Any:
    if name in _CACHES:
        import runner.engine.kvcache

        return getattr(runner.engine.kvcache, name)
    raise AttributeError(f"module 'kvbatch' has no attribute {name!r}")

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


def submit(documents: str | os.PathLike[str] | Iterable[Mapping[str, Any]], *,
           job_dir: str | os.PathLike[str] | None = None, config: JobConfig | str | os.PathLike[str] | None = None,
           settings: Mapping[str, Any] | None = None, address: str | None = None, glob: str | None = None,
           strict: bool = False, quiet: bool = False) -> Job:
    """Summarises `documents` into the new job folder `job_dir` and returns once the batch ended.

    `documents` is what `kvbatch submit` takes (a manifest, a folder of documents, an s3:// prefix) or
    the manifest's rows themselves: dicts with an `id` and a `text` or a `path` (relative to the
    working directory), optional `max_new_tokens`, `prompt` and metadata; a bad row is rejected alone
    and named by its place ("documents row 3", from 1), as a manifest's line is. `job_dir`: by default
    `runs/<job id>`, as the CLI's (`Job.job_dir` names it). `config`: a `JobConfig` (`kvbatch.read_config`)
    or a YAML file (default: the defaults); `settings`: keys changed in it, with their values
    (`{"summarize.max_new_tokens": 64}`, as `--set` names them); `quiet` keeps the progress lines off stderr.
    """
    source = str(documents) if isinstance(documents, (str, os.PathLike)) else _rows(documents)
    job_id = new_job_id()
    folder = str(job_dir) if job_dir is not None else str(DEFAULT_JOBS_DIR / job_id)
    code = runner_submit.submit(source, glob, _config(config, settings), folder, address, strict, _console(quiet),
                                job_id)
    return Job(folder, code)


def resume(job_dir: str | os.PathLike[str], *, retry_failed: bool = False, settings: Mapping[str, Any] | None = None,
           address: str | None = None, quiet: bool = False) -> Job:
    """Runs what a job has not finished (after Ctrl-C, a crash, a full disk); `retry_failed`: its failures too."""
    code = runner_submit.resume(str(job_dir), retry_failed, _settings(settings), address, _console(quiet), SETTINGS)
    return Job(str(job_dir), code)


def results(job_dir: str | os.PathLike[str], *, errors_only: bool = False,
            with_text: bool = False) -> list[dict[str, Any]]:
    """One row per document, in the order they were given, as `kvbatch results` writes them (docs/results.md)."""
    return result_rows(str(job_dir), errors_only, with_text)


def status(job_dir: str | os.PathLike[str]) -> JobStatus:
    """Where a job stands, running or not, as `kvbatch status --json` prints it: counts by state, pace, ETA,
    the documents running now, fallbacks, alerts (runner/observe/status.py `JobStatus`)."""
    return job_status(str(job_dir))


def _rows(documents: Any) -> list[Any]:
    """The rows themselves, each checked as a manifest's row is (jobs/manifest.py `read_rows`); what is
    no list of rows at all is refused whole."""
    if isinstance(documents, (Mapping, bytes, bytearray)) or not isinstance(documents, Iterable):
        raise ManifestError(f"documents must be a list of rows (dicts with an 'id' and a 'text' or a 'path'), "
                            f"a manifest or a folder, got {type(documents).__name__}: give one document as [row]")
    return list(documents)


SETTINGS = "settings"
"""How an error names what the API's caller changed in the config (the CLI's: `--set`)."""


def _config(config: Any, settings: Any) -> JobConfig:
    """The job's config: `config` (a JobConfig, a YAML file, None: the defaults) with `settings` set."""
    changes = _settings(settings)
    if isinstance(config, JobConfig):
        data = apply_settings(config.model_dump(mode="json"), changes, SETTINGS)
        return config_from_dict(data, f"the config given with {SETTINGS}" if changes else "the config given")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a JobConfig (kvbatch.read_config) or a YAML file's path, "
                          f"got {type(config).__name__}")
    return read_config(config, changes, SETTINGS)


def _settings(settings: Any) -> dict[str, Any]:
    """Config keys and values as given: plain values only (what a YAML config could hold)."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"settings must be a dict of config keys and values ({{'summarize.max_new_tokens': 64}}), "
                          f"got {type(settings).__name__}")
    for key, value in settings.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise ConfigError(f"settings[{key!r}] is {type(value).__name__} {value!r}, which no config key takes: "
                              "give a number, a string, a boolean, a list or a dict") from None
    return dict(settings)


def _console(quiet: bool) -> Console:
    return Console(stderr=True, quiet=quiet, soft_wrap=True)
