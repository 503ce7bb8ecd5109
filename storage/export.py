"""`kvbatch results`: one row per document, the manifest's metadata expanded into its own columns."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from jobs.documents import DocumentError, load_task_text
from jobs.manifest import tasks_from_table
from jobs.schema import TaskState
from storage.checkpoint import load_state
from storage.jobdir import JobDir, read_manifest_table
from storage.location import Where

ExportFormat = Literal["jsonl", "csv", "parquet"]


def format_for(path: Path | None, requested: str | None) -> ExportFormat:
    """--format wins; else the output file's extension; else JSON lines."""
    if requested:
        return requested  # type: ignore[return-value]
    if path is not None and path.suffix.lstrip(".") in ("csv", "parquet"):
        return path.suffix.lstrip(".")  # type: ignore[return-value]
    return "jsonl"


def _texts(job_dir: Where, task_ids: list[str]) -> list[str | None]:
    """The text each task's model was given, extracted again (and checked against its fingerprint).

    Null for a rejected row, and for a document that changed or vanished since (said on stderr).
    """
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


def results_table(job_dir: Where, errors_only: bool, with_text: bool = False) -> pa.Table:
    """Deduplicated results; `errors_only` keeps failed and rejected documents; `with_text` adds a `text` column."""
    table = load_state(job_dir).results
    if errors_only:
        table = table.filter(pc.not_equal(table["status"], TaskState.DONE.value))
    if with_text:
        table = table.append_column("text", pa.array(_texts(job_dir, table["task_id"].to_pylist()), pa.string()))
    metas = [json.loads(m) if m else {} for m in table["meta"].to_pylist()]
    table = table.drop_columns(["meta"])
    for key in sorted({k for m in metas for k in m}):
        name = key if key not in table.column_names else f"meta_{key}"
        values = [m.get(key) for m in metas]
        if any(isinstance(v, (dict, list)) for v in values):
            values = [json.dumps(v) if v is not None else None for v in values]
        table = table.append_column(name, pa.array(values))
    return table


def export_results(job_dir: Where, out: Path | None, fmt: ExportFormat, errors_only: bool,
                   with_text: bool = False) -> int:
    """Writes the rows to `out` (stdout when None; not for parquet); returns the row count."""
    table = results_table(job_dir, errors_only, with_text)
    if fmt == "parquet":
        if out is None:
            raise ValueError("parquet output needs a file: add -o results.parquet")
        pq.write_table(table, out)
    elif fmt == "csv":
        flat = table.set_column(
            table.schema.get_field_index("fallbacks"), "fallbacks",
            pa.array([";".join(v or []) for v in table["fallbacks"].to_pylist()]),
        )
        if out is None:
            sink = pa.BufferOutputStream()
            pacsv.write_csv(flat, sink)
            sys.stdout.write(sink.getvalue().to_pybytes().decode())
        else:
            pacsv.write_csv(flat, out)
    else:
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in table.to_pylist())
        if out is None:
            sys.stdout.write(lines)
        else:
            out.write_text(lines, encoding="utf-8")
    return table.num_rows
