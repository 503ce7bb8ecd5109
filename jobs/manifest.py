"""Turning a user's manifest (JSONL, CSV or Parquet) into validated tasks and per-row rejections.

A bad row must never stop a batch nor crash the parser: it becomes a `Rejection` naming the row, the
document and what to do. Only a manifest that cannot be read at all raises `ManifestError`.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import unicodedata
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.chunking import merge_room
from jobs.config import ConfigError, InputConfig, max_answer_tokens
from jobs.documents import (
    DocumentError,
    check_size,
    check_text,
    read_document,
    read_uri_document,
    resolve_document_path,
    text_sha256,
)
from jobs.extract import Extracted
from jobs.schema import MANIFEST_SCHEMA
from jobs.task import Task
from jobs.uris import is_uri

#: Manifest fields with a meaning; every other field is metadata passed through to the results.
OVERRIDE_FIELDS = ("max_new_tokens", "prompt")
RESERVED_FIELDS = ("id", "text", "path", *OVERRIDE_FIELDS)
MAX_ID_CHARS = 1024
#: Unicode's explicit bidirectional formatting characters (UAX #9): an id holding one (U+202E, right-to-left
#: override) is shown reversed by `status` and in a terminal, so ids are refused with them as with C0 controls.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_SUFFIXES_HELP = ".jsonl, .ndjson, .json, .csv or .parquet (.gz allowed except for Parquet)"


class ManifestError(ValueError):
    """The manifest file itself is unusable; nothing can start (exit 2)."""


@dataclass(frozen=True)
class Rejection:
    """A manifest row that will not run.

    `row` is 1-based: the line for JSONL, the record counting the header as row 1 for CSV (as a
    spreadsheet shows it), the item for a JSON array, the row for Parquet.
    """

    row: int
    doc_id: str | None
    reason: str
    meta: dict = field(default_factory=dict)  # the row's metadata when it could be parsed

    @property
    def task_id(self) -> str:
        return task_id_for_row(self.row)


def task_id_for_row(row: int) -> str:
    """Stable across re-reads of the same manifest, and shared by tasks and rejections."""
    return f"t{row:06d}"


def row_of_task_id(task_id: str) -> int:
    """The manifest row a task id was made from: how exports list documents in the manifest's order."""
    return int(task_id[1:])


@dataclass(frozen=True)
class PromptMeasure:
    """How a row's `prompt` is measured: with the model's tokenizer, as submit's settings check measures
    summarize.prompt (runner/preflight.py)."""

    prompt_tokens: Callable[[str], int]  # a pass's prompt with this instruction and no document: template, margin
    separator_tokens: int  # of the text that joins partial summaries (jobs.chunking.SUMMARY_SEPARATOR)
    max_new_tokens: int  # summarize.max_new_tokens: the answer of a row that does not set its own


class _RowRejected(Exception):
    def __init__(self, problem: str, doc_id: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.doc_id = doc_id


@dataclass(frozen=True)
class _Record:
    """One raw manifest row: its fields, or the reason it could not even be parsed."""

    row: int
    fields: dict[str, Any] | None
    problem: str | None = None


# ---------------------------------------------------------------- field validation


def _shown(value: Any) -> str:
    """A value as messages quote it: hostile rows can hold megabytes in one field."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _doc_id(value: Any) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _RowRejected("has no 'id': give every document a unique id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _RowRejected(f"'id' must be a string or an integer, got {type(value).__name__} {_shown(value)}")
    doc_id = str(value)
    if len(doc_id) > MAX_ID_CHARS:
        raise _RowRejected(f"'id' is {len(doc_id)} characters long (at most {MAX_ID_CHARS}): use a shorter id")
    if any(unicodedata.category(c) == "Cc" for c in doc_id):
        raise _RowRejected(
            f"'id' {_shown(doc_id)} contains control characters (newline, tab, NUL...): use printable ids"
        )
    if bidi := sorted({f"U+{ord(c):04X}" for c in doc_id if c in BIDI_CONTROLS}):
        raise _RowRejected(
            f"'id' {_shown(doc_id)} contains bidirectional text controls ({', '.join(bidi)}), which make a terminal "
            "show it reordered: use ids without them"
        )
    return doc_id


def _id_or_none(value: Any) -> str | None:
    """The id to name a rejected row by, when it has a usable one."""
    try:
        return _doc_id(value)
    except _RowRejected:
        return None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _RowRejected(f"'{name}' must be a positive integer, got {_shown(value)}: fix or remove it")
    return value


def _answer_room(max_new_tokens: int, context_tokens: int | None) -> int:
    """The row's answer may take at most half the context, as `summarize.max_new_tokens` may."""
    if context_tokens is not None and max_new_tokens > (most := max_answer_tokens(context_tokens)):
        raise _RowRejected(
            f"'max_new_tokens' ({max_new_tokens}) leaves too little of summarize.context_tokens ({context_tokens}) "
            f"for the prompt and the document (the answer may take at most half): set it to {most} or less, or "
            f"summarize.context_tokens to {2 * max_new_tokens} or more"
        )
    return max_new_tokens


def _prompt_room(prompt: str, max_new_tokens: int, context_tokens: int, measure: PromptMeasure) -> None:
    """A row's prompt leaves a pass room for its answer and the document: at least two partial summaries of
    a long one, so they can merge (the room summarize.prompt must leave, at the row's context)."""
    tokens = measure.prompt_tokens(prompt)
    room = merge_room(context_tokens, tokens, max_new_tokens, measure.separator_tokens)
    if room < 0:
        raise _RowRejected(
            f"'prompt' takes {tokens} tokens (chat template included): with an answer of up to {max_new_tokens} "
            f"tokens it leaves a pass of summarize.context_tokens ({context_tokens}) no room for the document and "
            f"two partial summaries to merge: shorten it by {-room} tokens or more, lower the row's "
            "max_new_tokens, or raise summarize.context_tokens"
        )


def _overrides(fields: dict[str, Any], context_tokens: int | None, measure: PromptMeasure | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if (value := fields.get("max_new_tokens")) is not None:
        overrides["max_new_tokens"] = _answer_room(_positive_int("max_new_tokens", value), context_tokens)
    if (value := fields.get("prompt")) is not None:
        if not isinstance(value, str) or not value.strip():
            raise _RowRejected(f"'prompt' must be a non-empty string, got {_shown(value)}: fix or remove it")
        if measure is not None and context_tokens is not None:
            _prompt_room(value, overrides.get("max_new_tokens", measure.max_new_tokens), context_tokens, measure)
        overrides["prompt"] = value
    return overrides


def _metadata(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k not in RESERVED_FIELDS}


#: Half of a UTF-16 pair on its own: JSON can spell it (\ud800), UTF-8 cannot store it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _first_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a string, or in the keys and values of nested metadata."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return found.group() if found else None
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((found for item in items if (found := _first_surrogate(item)) is not None), None)


def _repaired(value: Any) -> Any:
    """`value` with every lone surrogate replaced by U+FFFD, so what a rejection keeps can be stored."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_repaired(k): _repaired(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_repaired(v) for v in value]
    return value


def _check_surrogates(fields: dict[str, Any]) -> None:
    for key, value in fields.items():
        found = _first_surrogate(key) or _first_surrogate(value)
        if found is not None:
            field = f"'{key}'" if key in RESERVED_FIELDS else f"metadata {_shown(key)}"
            raise _RowRejected(
                f"{field} contains a lone UTF-16 surrogate ({found!r}, an invalid \\u escape, common in "
                "scraped text) that UTF-8 cannot store: fix the escape or replace it with U+FFFD",
                _id_or_none(_repaired(fields.get("id"))),
            )


def _inline_text(value: Any) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise _RowRejected("'text' is not valid UTF-8: convert it to UTF-8") from None
    if not isinstance(value, str):
        raise _RowRejected(f"'text' must be a string, got {type(value).__name__}")
    return value


def _json_default(value: Any) -> Any:
    """Parquet metadata may hold dates, decimals or bytes; keep them readable in JSON."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def table_json(obj: dict[str, Any]) -> str:
    """Overrides or metadata as the job folder's tables keep them: task and rejected rows alike."""
    return json.dumps(obj, ensure_ascii=False, default=_json_default)


# ---------------------------------------------------------------- rows -> tasks


@dataclass
class _Validator:
    manifest_dir: Path
    max_bytes: int
    documents_root: Path | None
    row_unit: str  # "line", "row" or "item", as messages call a row of this manifest
    uri_base: str | None  # the folder URI of a manifest read from shared storage
    context_tokens: int | None  # summarize.context_tokens, which bounds a row's max_new_tokens and prompt
    prompt_measure: PromptMeasure | None  # how a row's prompt is measured (None: not checked)
    seen_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # NFC-normalised id -> (row, id as given)

    def task(self, record: _Record) -> Task:
        if record.fields is None:
            raise _RowRejected(record.problem or "cannot be parsed")
        fields = record.fields
        _check_surrogates(fields)
        doc_id = _doc_id(fields.get("id"))
        try:
            self._claim_id(doc_id, record.row)
            overrides = _overrides(fields, self.context_tokens, self.prompt_measure)
            source_type, source, document = self._document(fields)
        except _RowRejected as e:
            raise _RowRejected(e.problem, doc_id) from None
        return Task(
            task_id=task_id_for_row(record.row),
            doc_id=doc_id,
            source_type=source_type,
            source=source,
            n_chars=len(document.text),
            n_bytes=document.n_bytes,
            sha256=text_sha256(document.text),
            overrides=overrides,
            meta=_metadata(fields),
            source_format=document.source_format,
            encoding=document.encoding,
        )

    def _claim_id(self, doc_id: str, row: int) -> None:
        """The first row with an id owns it, even if that row is rejected for another reason."""
        key = unicodedata.normalize("NFC", doc_id)
        if key in self.seen_ids:
            first_row, first_id = self.seen_ids[key]
            same = "the same id" if first_id == doc_id else f"id {first_id!r} (equal after Unicode normalisation)"
            raise _RowRejected(
                f"duplicate id: {self.row_unit} {first_row} already has {same}; ids must be unique, rename one"
            )
        self.seen_ids[key] = (row, doc_id)

    def _document(self, fields: dict[str, Any]) -> tuple[str, str, Extracted]:
        text, path = fields.get("text"), fields.get("path")
        if text is not None and path is not None:
            raise _RowRejected("has both 'text' and 'path': give exactly one of them")
        if text is None and path is None:
            raise _RowRejected("has neither 'text' nor 'path': give the document inline as 'text' or as a file 'path'")
        try:
            if text is not None:
                text = check_text("'text'", _inline_text(text))
                n_bytes = len(text.encode("utf-8"))
                check_size("'text'", n_bytes, self.max_bytes)
                return "text", text, Extracted(text, "text", None, n_bytes)
            if not isinstance(path, str) or not path.strip():
                raise _RowRejected(f"'path' must be a non-empty string, got {_shown(path)}")
            if self.uri_base is not None and not is_uri(path) and not path.startswith("/"):
                path = f"{self.uri_base}/{path}"  # relative to a manifest on shared storage: beside it there
            if is_uri(path):
                if self.documents_root is not None:
                    raise DocumentError(
                        f"is a storage URI, but input.documents_root ({self.documents_root}) only allows "
                        "files under it: unset documents_root to read documents from shared storage"
                    )
                return "path", path, read_uri_document(path, self.max_bytes)
            # Relative paths are relative to the manifest, not to wherever kvbatch was started.
            resolved = resolve_document_path(self.manifest_dir / Path(path).expanduser(), self.documents_root)
            return "path", str(resolved), read_document(resolved, self.max_bytes, self.documents_root)
        except DocumentError as e:
            raise _RowRejected(str(e) if text is not None else f"'path' {_shown(path)}: {e}") from None


# ---------------------------------------------------------------- file formats


def _open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError(f"key {_first_duplicate([k for k, _ in pairs])!r} appears twice in one object")
    return obj


def _json_record(row: int, line: str) -> _Record:
    try:
        value = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object {{...}}, got {type(value).__name__}")
        return _Record(row, value)
    except RecursionError:
        return _Record(row, None, "is not valid JSON (nested too deeply): give one flat JSON object")
    except ValueError as e:
        return _Record(row, None, f"is not valid JSON ({e}): give one JSON object a line")


def _jsonl_records(stream: BinaryIO, max_line_bytes: int) -> Iterator[_Record]:
    for row, line in enumerate(iter(lambda: stream.readline(max_line_bytes + 1), b""), start=1):
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield _Record(row, None, f"is longer than {max_line_bytes} bytes: split the document or give it as a 'path'")
            continue
        if row == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield _Record(row, None, f"is not valid UTF-8 (byte offset {e.start} in the line): save the manifest as UTF-8")
            continue
        if decoded.strip():
            yield _json_record(row, decoded)


def _json_array_records(stream: BinaryIO) -> Iterator[_Record]:
    try:
        items = json.loads(stream.read().decode("utf-8-sig"))
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"is not a valid JSON array ({e}): fix it, or write one JSON object a line") from None
    if not isinstance(items, list):
        raise ManifestError("is JSON but not an array of objects: write one JSON object a line (JSONL)")
    for row, item in enumerate(items, start=1):
        if isinstance(item, dict):
            yield _Record(row, item)
        else:
            yield _Record(row, None, f"is not a JSON object (got {type(item).__name__}): give objects with an 'id'")


def _first_duplicate(names: list[str]) -> str | None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _check_columns(names: list[str]) -> None:
    if "" in names:
        raise ManifestError(f"column {names.index('') + 1} of the header has no name: name it or remove it "
                            "(pandas: index=False)")
    if (dup := _first_duplicate(names)) is not None:
        raise ManifestError(f"column {dup!r} appears twice in the header: rename one")
    if "id" not in names:
        raise ManifestError(f"has no 'id' column (columns: {', '.join(names)}): add one with a unique id per document")
    if "text" not in names and "path" not in names:
        raise ManifestError("has neither a 'text' nor a 'path' column: add one holding the documents or their paths")


def _csv_records(stream: BinaryIO, max_field_chars: int) -> Iterator[_Record]:
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline="")
    csv.field_size_limit(max(csv.field_size_limit(), max_field_chars))
    reader = csv.reader(text, strict=True)
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise ManifestError("is empty: give a header row (id,text or id,path) and one row per document") from None
    except csv.Error as e:
        raise ManifestError(f"has an unreadable header ({e}): fix the first line") from None
    if any(_has_surrogates(h) for h in header):
        raise ManifestError("header is not valid UTF-8: save the manifest as UTF-8")
    _check_columns(header)
    row = 1
    while True:
        row += 1
        first_line = reader.line_num + 1
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            _refuse_if_rows_merged(first_line, reader.line_num, str(e))
            yield _Record(row, None, f"is not valid CSV ({e}, line {reader.line_num}): check the quoting")
            continue
        if not values:
            row -= 1  # a blank line is not a record
            continue
        if any(_has_surrogates(v) for v in values):
            yield _Record(row, None, "is not valid UTF-8: save the manifest as UTF-8")
        elif len(values) != len(header):
            _refuse_if_rows_merged(first_line, reader.line_num, f"{len(values)} fields, the header has {len(header)}")
            yield _Record(row, None, f"has {len(values)} fields but the header has {len(header)}: check the commas and quoting")
        else:
            fields = dict(zip(header, values))
            # CSV cannot tell an empty cell from a missing value; for the reserved fields it means absent.
            yield _Record(row, {k: (None if k in RESERVED_FIELDS and v == "" else v) for k, v in fields.items()})


def _refuse_if_rows_merged(first_line: int, last_line: int, problem: str) -> None:
    """A broken record over several lines may hold rows a stray quote swallowed: which ones is unknowable."""
    if last_line > first_line:
        raise ManifestError(
            f"line {first_line}: a quote opened on this line is not closed where a field ends ({problem}), so "
            f"lines {first_line}-{last_line} cannot be told apart into rows: close the quote, or double a quote "
            'that belongs to the text ("")'
        )


def _has_surrogates(value: str) -> bool:
    return any("\udc80" <= c <= "\udcff" for c in value)


def _parquet_records(path: Path) -> Iterator[_Record]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"is not a readable Parquet file ({e}): rewrite it") from None
    with parquet:
        _check_columns(list(parquet.schema_arrow.names))
        row = 0
        try:
            for batch in parquet.iter_batches(batch_size=1024):
                for fields in batch.to_pylist():
                    row += 1
                    yield _Record(row, {k: _nan_to_none(v) if k in RESERVED_FIELDS else v for k, v in fields.items()})
        except (pa.ArrowException, OSError) as e:
            raise ManifestError(f"cannot be read after row {row} ({e}): rewrite the Parquet file") from None


def _nan_to_none(value: Any) -> Any:
    """pandas writes missing values of numeric columns as NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value


#: What a manifest row is called in messages, per format.
_ROW_UNITS = {"parquet": "row", "csv": "row", "jsonl": "line", "json-array": "item"}


def _format(path: Path) -> str:
    name = path.name.lower()
    base = name.removesuffix(".gz")
    if name.endswith(".parquet"):
        return "parquet"
    if base.endswith(".csv"):
        return "csv"
    if base.endswith(".json"):
        with _open_binary(path) as stream:
            if stream.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
                return "json-array"
    if base.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    raise ManifestError(f"has an unknown extension: use {_SUFFIXES_HELP}")


def _records(path: Path, fmt: str, max_bytes: int) -> Iterator[_Record]:
    # A text row can hold a whole document, and a JSON escape such as \u00e9 spends 6 bytes on one.
    max_line_bytes = 6 * max_bytes + (1 << 20)
    if fmt == "parquet":
        yield from _parquet_records(path)
        return
    with _open_binary(path) as stream:
        if fmt == "csv":
            yield from _csv_records(stream, max_line_bytes)
        elif fmt == "json-array":
            yield from _json_array_records(stream)
        else:
            yield from _jsonl_records(stream, max_line_bytes)


def _documents_root(input_cfg: InputConfig) -> Path | None:
    if input_cfg.documents_root is None:
        return None
    root = Path(input_cfg.documents_root).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"input.documents_root {input_cfg.documents_root} is not a directory: fix the setting")
    return root


def read_manifest(
    path: Path, input_cfg: InputConfig, uri_base: str | None = None, context_tokens: int | None = None,
    prompt_measure: PromptMeasure | None = None,
) -> tuple[list[Task], list[Rejection]]:
    """Every runnable task of the manifest, and every row that will not run with its reason.

    `uri_base`: the folder on shared storage the manifest was copied from; relative document paths are
    read from there. `context_tokens` bounds a row's `max_new_tokens` and, measured by `prompt_measure`,
    its `prompt` (None: not checked)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist or is not a file: check the path")
    try:
        fmt = _format(path)
        validator = _Validator(path.resolve().parent, input_cfg.max_document_bytes, _documents_root(input_cfg),
                               _ROW_UNITS[fmt], uri_base, context_tokens, prompt_measure)
        tasks, rejections = _validate(validator, _records(path, fmt, input_cfg.max_document_bytes), path.name)
    except ManifestError as e:
        raise ManifestError(f"manifest {path} {e}") from None
    except (OSError, EOFError, zlib.error) as e:
        raise ManifestError(f"manifest {path} cannot be read ({e}): check the file (a truncated .gz?)") from None
    if not tasks and not rejections:
        raise ManifestError(f"manifest {path} has no documents: add one row per document")
    return tasks, rejections


def _validate(validator: _Validator, records: Iterator[_Record], name: str) -> tuple[list[Task], list[Rejection]]:
    """Each record becomes a task, or a rejection whose reason names `name`, the row and its id."""
    tasks: list[Task] = []
    rejections: list[Rejection] = []
    for record in records:
        try:
            tasks.append(validator.task(record))
        except _RowRejected as e:
            where = f"{name} {validator.row_unit} {record.row}"
            where += f" (id {e.doc_id!r})" if e.doc_id is not None else ""
            meta = _repaired(_metadata(record.fields)) if record.fields is not None else {}
            rejections.append(Rejection(record.row, e.doc_id, f"{where}: {e.problem}", meta))
    return tasks, rejections


def _row_record(row: int, value: Any) -> _Record:
    """A row a program gave: a dict with string keys, as a JSON manifest's line parses to."""
    if not isinstance(value, Mapping):
        return _Record(row, None, f"is not a dict (got {type(value).__name__}): give each document as a dict with "
                                  "an 'id' and a 'text' or a 'path'")
    if (key := next((k for k in value if not isinstance(k, str)), None)) is not None:
        return _Record(row, None, f"has a key that is not a string ({_shown(key)}): name every field with a string")
    return _Record(row, dict(value))


def read_rows(
    rows: Iterable[Any], input_cfg: InputConfig, base_dir: Path, context_tokens: int | None = None,
    prompt_measure: PromptMeasure | None = None,
) -> tuple[list[Task], list[Rejection]]:
    """The documents a program gives as rows (`kvbatch.submit`), read as a manifest's are, without a file:
    a bad row is rejected alone, named "documents row N" (from 1); a relative `path` is read from `base_dir`.
    Python values no JSON line holds (bytes, dates) follow the rules of a Parquet manifest's."""
    validator = _Validator(base_dir, input_cfg.max_document_bytes, _documents_root(input_cfg), "row", None,
                           context_tokens, prompt_measure)
    tasks, rejections = _validate(validator, (_row_record(n, row) for n, row in enumerate(rows, start=1)), "documents")
    if not tasks and not rejections:
        raise ManifestError("the documents given are an empty list: give one row per document")
    return tasks, rejections


# ---------------------------------------------------------------- job folder table


def tasks_to_table(tasks: list[Task]) -> pa.Table:
    """The normalised manifest stored in the job folder (overrides and meta as JSON text)."""
    rows = [{**vars(t), "overrides": table_json(t.overrides), "meta": table_json(t.meta)} for t in tasks]
    return pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)


def tasks_from_table(table: pa.Table) -> list[Task]:
    optional = ("source_format", "encoding")  # absent from manifests written before document formats
    if missing := [name for name in MANIFEST_SCHEMA.names if name not in table.column_names and name not in optional]:
        raise ManifestError(
            f"normalised manifest lacks column(s) {', '.join(missing)}: the job folder is damaged, submit the job again"
        )
    rows = table.select([name for name in MANIFEST_SCHEMA.names if name in table.column_names]).to_pylist()
    return [Task(**{**r, "overrides": json.loads(r["overrides"]), "meta": json.loads(r["meta"])}) for r in rows]
