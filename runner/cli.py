"""The `kvbatch` command line (docs/design.md "Command line" is its contract)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from jobs.config import ConfigError, load_config, parse_overrides
from jobs.manifest import ManifestError
from jobs.uris import UnsupportedURIError, check_supported, is_uri
from runner import __version__
from runner.engine.model_loader import HUB_OFFLINE_ENV
from storage.jobdir import JobDir, JobDirError, check_job_folder
from storage.location import StorageError
from storage.lock import JobLockedError
from storage.scratch import ScratchError

# rich_markup_mode=None: typer's rich help gives every option a type column, flags too (`--strict <bool>`)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Summarise thousands of long documents on Ray, with KV caches that fit.")
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

EXIT_USAGE = 2
#: Errors the user fixes: a clear message and exit 2, never a traceback.
USER_ERRORS = (ConfigError, ManifestError, JobDirError, JobLockedError, ScratchError, StorageError, UnsupportedURIError)

SetOption = Annotated[list[str], typer.Option(
    "--set", metavar="KEY=VALUE", help="dotted config key=value, e.g. cache.strategy=tiered-disk")]
JOB_DIR_HELP = "job folder: a path, or s3://bucket/prefix, file:///path on shared storage"
JobDirArgument = Annotated[str, typer.Argument(metavar="JOB_DIR", help=JOB_DIR_HELP)]
AddressOption = Annotated[Optional[str], typer.Option(
    "--address", metavar="HOST:PORT", help="join this Ray cluster (default: $RAY_ADDRESS or a private local one)")]
ConfigOption = Annotated[Optional[Path], typer.Option("-c", "--config", metavar="CONFIG", help="YAML config")]


def _run(fn, *args) -> None:  # noqa: ANN001 - thin wrapper shared by the commands
    try:
        code = fn(*args)
    except USER_ERRORS as e:
        errors.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    raise typer.Exit(code)


def _show_version(show: bool) -> None:
    if show:
        sys.stdout.write(f"kvbatch {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True, help="print the version and exit")] = False) -> None:
    """Summarise thousands of long documents on Ray, with KV caches that fit."""


def _check_where(name: str, folder_of_a_job: bool = False) -> None:
    """A gs:// URI refused, and (`folder_of_a_job`) a local folder that holds no job, before any storage call."""
    if is_uri(name):
        check_supported(name)
    elif folder_of_a_job:
        check_job_folder(JobDir(name))


def _check_source(source: str) -> None:
    """A local manifest or folder of documents that is not there is refused before anything starts."""
    _check_where(source)
    if not is_uri(source) and not Path(source).expanduser().exists():
        raise ManifestError(f"{source} does not exist: give a manifest file (JSONL, CSV, Parquet) or a folder "
                            "of documents")


@app.command()
def submit(
    source: Annotated[str, typer.Argument(
        metavar="MANIFEST|DIR|URI",
        help="JSONL, CSV or Parquet manifest, or a folder of documents (id = path in the folder); "
             "local, or s3://, file:// on shared storage")],
    glob: Annotated[Optional[str], typer.Option(
        "--glob", metavar="PATTERN",
        help="with a folder: only files whose relative path matches, e.g. '*.pdf'")] = None,
    config: ConfigOption = None,
    job_dir: Annotated[Optional[str], typer.Option(
        "-j", "--job-dir", metavar="JOB_DIR", help=JOB_DIR_HELP + " (default runs/<job-id>)")] = None,
    set_: SetOption = [],
    address: AddressOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="any rejected manifest row stops everything (exit 2)")] = False,
) -> None:
    """Validate the manifest (or list the folder), create the job folder and run every task to an end."""

    def early() -> int:
        """What the user typed, checked before runner.submit imports Ray and the settings check transformers."""
        resolved = load_config(config, set_)
        _check_source(source)
        if job_dir is not None:
            _check_where(job_dir)
        from runner.submit import submit as run_submit

        return run_submit(source, glob, resolved, job_dir, address, strict, console)

    _run(early)


@app.command()
def resume(
    job_dir: JobDirArgument,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="also rerun documents that failed")] = False,
    set_: SetOption = [],
    address: AddressOption = None,
) -> None:
    """Continue a job: skip finished documents, run the rest."""

    def early() -> int:
        """The folder and the --set syntax, checked before runner.submit imports Ray."""
        _check_where(job_dir, folder_of_a_job=True)
        settings = parse_overrides(set_)
        from runner.submit import resume as run_resume

        return run_resume(job_dir, retry_failed, settings, address, console)

    _run(early)


@app.command()
def status(job_dir: JobDirArgument, as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False) -> None:
    """Counts per state, throughput, ETA, fallbacks and the slowest documents."""
    from runner.observe.status import job_status, print_status

    def show() -> int:
        figures = job_status(job_dir)
        if as_json:
            sys.stdout.write(json.dumps(figures, indent=2) + "\n")
        else:
            print_status(figures, console)
        return 0

    _run(show)


@app.command()
def results(
    job_dir: JobDirArgument,
    output: Annotated[Optional[Path], typer.Option(
        "-o", "--output",
        help="file to write (default stdout; - or /dev/stdout: into stdout as it is, parquet too)")] = None,
    fmt: Annotated[Optional[str], typer.Option(
        "--format",
        help="jsonl, csv or parquet (default: from -o's extension .jsonl, .csv or .parquet, else jsonl)")] = None,
    errors_only: Annotated[bool, typer.Option("--errors", help="only failed and rejected documents")] = False,
    with_text: Annotated[bool, typer.Option("--with-text", help="add a text column: the extracted text each model was given")] = False,
) -> None:
    """Export one row per document."""
    from storage.export import export_results, format_for
    from storage.output import STDOUT

    def export() -> int:
        chosen = format_for(output, fmt)  # an unknown --format or extension: refused before anything is read
        n = export_results(job_dir, output, chosen, errors_only, with_text)
        if output is not None and str(output) != STDOUT:
            errors.print(f"{n} row(s) -> {escape(str(output))}", highlight=False)
        return 0

    _run(export)


@app.command()
def clean(
    job_dir: Annotated[Optional[str], typer.Argument(help="only this job's scratch dirs")] = None,
    offload_root: Annotated[Optional[Path], typer.Option("--offload-root", help="the offload root to sweep")] = None,
) -> None:
    """Remove per-task scratch dirs whose owner process is gone (never a live one)."""
    from runner.scratch_cleanup import clean_scratch

    _run(clean_scratch, job_dir, offload_root, console)


@app.command()
def report(
    job_dir: JobDirArgument,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="HTML file (default JOB_DIR/report.html)")] = None,
) -> None:
    """One self-contained HTML page: summary, plots, failures, fallbacks, alerts."""
    from runner.observe.report import write_report

    _run(write_report, job_dir, output, errors)  # where it went: stderr, the page may be stdout


@app.command()
def doctor(config: ConfigOption = None) -> None:
    """Check this machine: torch/CUDA, GPUs, copy bandwidth, offload root space and speed, RAM."""
    from runner.observe.doctor import doctor as run_doctor

    _run(lambda: run_doctor(load_config(config), console))


@app.command("config")
def show_config(
    config: Annotated[Optional[Path], typer.Option(
        "-c", "--config", metavar="CONFIG", help="YAML config (default: the defaults)")] = None,
    set_: SetOption = [],
    explain: Annotated[bool, typer.Option("--explain", help="a Markdown table per section: key, value, meaning")] = False,
) -> None:
    """Print the config a submit would run with, every key with what it means (no -c: configs/default.yaml)."""
    from jobs.config_reference import config_yaml, reference_tables

    def show() -> int:
        resolved = load_config(config, set_)
        sys.stdout.write(reference_tables(resolved, "value") if explain else config_yaml(resolved).lstrip("\n"))
        return 0

    _run(show)


def main() -> None:
    # no model is downloaded unless HF_HUB_OFFLINE=0 (model_loader.hub_downloads_allowed): set for this process
    # and the workers its private Ray starts, so no hub call of any library retries for minutes offline
    os.environ.setdefault(HUB_OFFLINE_ENV, "1")
    app()
