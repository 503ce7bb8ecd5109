"""The `kvbatch` command line (docs/design.md "Command line" is its contract)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from jobs.config import ConfigError
from jobs.manifest import ManifestError
from storage.jobdir import JobDirError
from storage.location import StorageError
from storage.lock import JobLockedError
from storage.scratch import ScratchError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Summarise thousands of long documents on Ray, with KV caches that fit.")
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

EXIT_USAGE = 2
#: Errors the user fixes: a clear message and exit 2, never a traceback.
USER_ERRORS = (ConfigError, ManifestError, JobDirError, JobLockedError, ScratchError, StorageError)

SetOption = Annotated[list[str], typer.Option("--set", help="dotted config key=value, e.g. cache.strategy=tiered-disk")]
JOB_DIR_HELP = "job folder: a path, or s3://bucket/prefix, gs://bucket/prefix, file:///path on shared storage"
JobDirArgument = Annotated[str, typer.Argument(help=JOB_DIR_HELP)]
AddressOption = Annotated[Optional[str], typer.Option("--address", help="join this Ray cluster (default: $RAY_ADDRESS or a private local one)")]


def _run(fn, *args) -> None:  # noqa: ANN001 - thin wrapper shared by the commands
    try:
        code = fn(*args)
    except USER_ERRORS as e:
        errors.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    raise typer.Exit(code)


@app.command()
def submit(
    source: Annotated[str, typer.Argument(
        help="JSONL, CSV or Parquet manifest, or a folder of documents (id = path in the folder); "
             "local, or s3://, gs://, file:// on shared storage")],
    glob: Annotated[Optional[str], typer.Option("--glob", help="with a folder: only files whose relative path matches, e.g. '*.pdf'")] = None,
    config: Annotated[Optional[Path], typer.Option("-c", "--config", help="YAML config")] = None,
    job_dir: Annotated[Optional[str], typer.Option("-j", "--job-dir", help=JOB_DIR_HELP + " (default runs/<job-id>)")] = None,
    set_: SetOption = [],
    address: AddressOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="any rejected manifest row stops everything (exit 2)")] = False,
) -> None:
    """Validate the manifest (or list the folder), create the job folder and run every task to an end."""
    from runner.submit import submit as run_submit

    _run(run_submit, source, glob, config, job_dir, set_, address, strict, console)


@app.command()
def resume(
    job_dir: JobDirArgument,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="also rerun documents that failed")] = False,
    set_: SetOption = [],
    address: AddressOption = None,
) -> None:
    """Continue a job: skip finished documents, run the rest."""
    from runner.submit import resume as run_resume

    _run(run_resume, job_dir, retry_failed, set_, address, console)


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
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="file to write (default stdout)")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", help="jsonl, csv or parquet (default: from -o, else jsonl)")] = None,
    errors_only: Annotated[bool, typer.Option("--errors", help="only failed and rejected documents")] = False,
    with_text: Annotated[bool, typer.Option("--with-text", help="add a text column: the extracted text each model was given")] = False,
) -> None:
    """Export one row per document."""
    from storage.export import export_results, format_for

    def export() -> int:
        if fmt not in (None, "jsonl", "csv", "parquet"):
            raise ConfigError(f"--format {fmt}: choose jsonl, csv or parquet")
        n = export_results(job_dir, output, format_for(output, fmt), errors_only, with_text)
        if output is not None:
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

    _run(write_report, job_dir, output, console)


@app.command()
def doctor(config: Annotated[Optional[Path], typer.Option("-c", "--config", help="YAML config")] = None) -> None:
    """Check this machine: torch/CUDA, GPUs, copy bandwidth, offload root space and speed, RAM."""
    from jobs.config import load_config
    from runner.observe.doctor import doctor as run_doctor

    _run(lambda: run_doctor(load_config(config), console))


@app.command("config")
def show_config(
    config: Annotated[Path | None, typer.Option("-c", "--config", help="YAML config (default: the defaults)")] = None,
    set_: SetOption = [],
    explain: Annotated[bool, typer.Option("--explain", help="a Markdown table per section: key, value, meaning")] = False,
) -> None:
    """Print the config a submit would run with, every key with what it means (no -c: configs/default.yaml)."""
    from jobs.config import load_config
    from jobs.config_reference import config_yaml, reference_tables

    def show() -> int:
        resolved = load_config(config, set_)
        sys.stdout.write(reference_tables(resolved, "value") if explain else config_yaml(resolved).lstrip("\n"))
        return 0

    _run(show)


def main() -> None:
    app()
