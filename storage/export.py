"""`kvbatch results`: one row per document, the manifest's metadata expanded into its own columns."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from jobs.config import ConfigError
from jobs.documents import DocumentError, load_task_text
from jobs.manifest import row_of_task_id, tasks_from_table
from jobs.schema import TaskState
from storage.checkpoint import load_state
from storage.jobdir import JobDir, check_job_folder, read_manifest_table
from storage.location import Where
from storage.output import STDOUT, descriptor_of, write_descriptor, write_output

ExportFormat = Literal["jsonl", "csv", "parquet"]
#: Columns of seconds since the epoch: text a person reads (ISO 8601, UTC) in JSON lines and CSV.
TIMESTAMP_COLUMNS = ("finished_at",)


#: What each output file extension means (any case); a name with none (`/dev/stdout`, a FIFO) is JSON lines.
FORMAT_OF_EXTENSION: dict[str, ExportFormat] = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",  # a .json file gets JSON lines, as it always has
    ".csv": "csv",
    ".parquet": "parquet",
}
FORMATS: tuple[ExportFormat, ...] = ("jsonl", "csv", "parquet")


def format_for(path: Path | str | None, requested: str | None) -> ExportFormat:
    """--format wins; else the output file's extension (none: JSON lines). An extension that names no
format kvbatch writes (`.xlsx`, `.gz`) is refused rather than filled with JSON lines."""
    if requested:
        if requested not in FORMATS:
            raise ConfigError(f"--format {requested}: choose jsonl, csv or parquet")
        return requested  # type: ignore[return-value]
    suffix = Path(path).suffix if path is not None else ""  # `-` (stdout) has none
    if not suffix:
        return "jsonl"
    if suffix.lower() not in FORMAT_OF_EXTENSION:
        raise ConfigError(
            f"-o {path}: kvbatch does not write {suffix} files; it writes jsonl, csv and parquet, chosen by the "
            "extension (.jsonl, .csv, .parquet): rename the file, or give --format jsonl, csv or parquet to "
            "write that format under this name"
        )
    return FORMAT_OF_EXTENSION[suffix.lower()]


def _texts(job_dir: Where, task_ids: list[str]) -> list[str | None]:
    """The text each task's model was given, extracted again and checked against its fingerprint: null
for a rejected row, and for a document that changed or vanished since (said on stderr)."""
    tasks = {t.task_id: t for t in tasks_from_table(read_manifest_table(JobDir(job_dir)))}
    texts: list[str | None] = []
    for task_id in task_ids:
        text = None
        if task_id in tasks:
            try:
                text = load_task_text(tasks[task_id])
            except DocumentError as e:
                sys.stderr.write(f"no text for task {task_id}: {e}\n")
        texts.append(text)
    return texts


INT64 = (-(2**63), 2**63 - 1)
FLOAT_EXACT_INT = 2**53  # larger integers would change value as floats


def _as_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def metadata_column(values: list[Any]) -> pa.Array:
    """One metadata key's values: typed when they share a type Arrow holds exactly, else JSON text
(manifests are ragged: `"legal"` on one row, `5` on the next, ids above 2^63)."""
    kinds = {type(v) for v in values if v is not None}
    ints = [v for v in values if type(v) is int]
    if kinds <= {str} or kinds == {bool}:
        return pa.array(values)
    if kinds == {int} and all(INT64[0] <= v <= INT64[1] for v in ints):
        return pa.array(values, pa.int64())
    if kinds == {int, float} and all(abs(v) <= FLOAT_EXACT_INT for v in ints):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    if kinds == {float}:
        return pa.array(values, pa.float64())
    return pa.array([_as_text(v) for v in values], pa.string())


def metadata_names(keys: list[str], result_columns: list[str]) -> dict[str, str]:
    """Column name per metadata key: its own unless a result column (or another key) has it, then `meta_`-prefixed."""
    taken = set(result_columns) | set(keys)
    names = {key: key for key in keys if key not in result_columns}
    for key in keys:
        if key not in names:
            name = f"meta_{key}"
            while name in taken:
                name = f"meta_{name}"
            names[key] = name
            taken.add(name)
    return names


def _results_and_metadata(job_dir: Where, errors_only: bool, with_text: bool
                          ) -> tuple[pa.Table, list[dict[str, Any]], dict[str, str]]:
    """Deduplicated result rows without `meta` (`with_text`: plus `text`), each row's metadata, its names."""
    check_job_folder(JobDir(job_dir))
    table = in_manifest_order(load_state(job_dir).results)
    if errors_only:
        table = table.filter(pc.not_equal(table["status"], TaskState.DONE.value))
    if with_text:
        table = table.append_column("text", pa.array(_texts(job_dir, table["task_id"].to_pylist()), pa.string()))
    metas = [json.loads(m) if m else {} for m in table["meta"].to_pylist()]
    table = table.drop_columns(["meta"])
    return table, metas, metadata_names(sorted({k for m in metas for k in m}), table.column_names)


def in_manifest_order(table: pa.Table) -> pa.Table:
    """Rows in the order the manifest listed their documents (results/ holds them as they finished)."""
    rows = pa.array([row_of_task_id(t) for t in table["task_id"].to_pylist()], pa.int64())
    return table.take(pc.sort_indices(rows))


def iso_time(seconds: float | None) -> str | None:
    """`finished_at` as a person reads it: 2026-12-04T16:31:16.123+00:00."""
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


def results_table(job_dir: Where, errors_only: bool, with_text: bool = False) -> pa.Table:
    """Deduplicated results; `errors_only` keeps failed and rejected documents; `with_text` adds a `text` column."""
    table, metas, names = _results_and_metadata(job_dir, errors_only, with_text)
    for key, name in names.items():
        table = table.append_column(name, metadata_column([m.get(key) for m in metas]))
    return table


def result_rows(job_dir: Where, errors_only: bool, with_text: bool = False) -> list[dict[str, Any]]:
    """The JSON lines export's rows as dicts: metadata as the manifest gave it, timestamps as ISO 8601 text."""
    table, metas, names = _results_and_metadata(job_dir, errors_only, with_text)
    rows = table.to_pylist()
    for row, meta in zip(rows, metas):
        row.update((column, iso_time(row[column])) for column in TIMESTAMP_COLUMNS)
        row.update((name, meta.get(key)) for key, name in names.items())
    return rows


def export_results(job_dir: Where, out: Path | str | None, fmt: ExportFormat, errors_only: bool,
                   with_text: bool = False) -> int:
    """Writes the rows to `out` and returns the row count. `out` None: to sys.stdout (not parquet);
    `-` (like `/dev/stdout`): into descriptor 1 as it is, parquet too."""
    to_stdout = out is not None and os.fspath(out) == STDOUT

    def write(data: Callable[[BinaryIO], object]) -> None:
        if out is None:  # text, through sys.stdout
            buffer = io.BytesIO()
            data(buffer)
            sys.stdout.write(buffer.getvalue().decode("utf-8"))
        elif to_stdout:
            write_descriptor("stdout", 1, data)
        else:
            write_output(out, data)  # type: ignore[arg-type]

    if fmt == "jsonl":
        rows = result_rows(job_dir, errors_only, with_text)
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        write(lambda handle: handle.write(lines.encode("utf-8")))
        return len(rows)
    table = results_table(job_dir, errors_only, with_text)
    if fmt == "parquet":
        if out is None:
            raise ConfigError("parquet output needs a file: add -o results.parquet (or -o - to write it to stdout)")
        fd = 1 if to_stdout else descriptor_of(out)
        if fd is not None and os.isatty(fd):
            raise ConfigError(f"-o {out} is a terminal and parquet is binary: redirect it to a file or a pipe, "
                              "or give -o results.parquet")
        write(lambda handle: pq.write_table(table, handle))
    else:
        flat = table.set_column(
            table.schema.get_field_index("fallbacks"), "fallbacks",
            pa.array([";".join(v or []) for v in table["fallbacks"].to_pylist()]),
        )
        for column in TIMESTAMP_COLUMNS:
            flat = flat.set_column(flat.schema.get_field_index(column), column,
                                   pa.array([iso_time(v) for v in flat[column].to_pylist()], pa.string()))
        write(lambda handle: pacsv.write_csv(flat, handle))
    return table.num_rows
