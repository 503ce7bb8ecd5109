"""Append-only Parquet part files that are either wholly visible or not there at all.

Temporary name, fsync, rename, directory fsync (docs/design.md, "Job folder"). Names sort in write order
(`part-<time_ns>-<seq>-<pid>-<random>.parquet`), the order rows are read in. A merged part names the parts
it replaces in its metadata, so a crash before its inputs are deleted never yields duplicate rows.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.schema import KEY_COLUMNS
from storage.location import Fence, Location, Where, fsync_directory, no_fence

PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
TEMP_PREFIX = ".tmp-"
#: The names kvbatch gives a part or its write's temporary file: removing passes deletes only files named so.
_OWN_PART_NAME = re.compile(r"(?:\.tmp-)?part-\d{20,}-\d{8,}-\d+-[0-9a-f]{6}\.parquet")
_REPLACES_KEY = b"kvbatch.replaces"
_READ_THREADS = 4  # small parts are dominated by per-file latency; a few threads overlap it
_RESCANS = 3  # extra listings that catch parts a concurrent merge published during a listing
_MAX_LISTINGS = 100  # bound on chasing merged parts of inputs that vanished mid-read

_name_lock = threading.Lock()
_last_time_ns = 0
_sequence = itertools.count()


#: What a user does about a damaged part; printed by `status` and `resume` after the parts they skipped.
CORRUPT_PART_ADVICE = (
    "a damaged part's rows are ignored and never overwritten: documents whose results were in it "
    "run again on `kvbatch resume`; move the file out of the job folder once you have looked at it"
)


@dataclass(frozen=True)
class CorruptPart:
    """A part that could not be used; its rows are missing from what was read."""

    path: Location
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def _next_part_name() -> str:
    """Strictly increasing within a process; pid + random suffix keep concurrent writers apart."""
    global _last_time_ns
    with _name_lock:
        _last_time_ns = max(_last_time_ns + 1, time.time_ns())
        stamp = _last_time_ns
        seq = next(_sequence)
    return f"part-{stamp:020d}-{seq:08d}-{os.getpid()}-{secrets.token_hex(3)}.parquet"


def write_part(directory: Where, table: pa.Table, replaces: Sequence[str] = (), fence: Fence = no_fence) -> Location:
    """Publish `table` as a new part in `directory` (created if missing) and return where it is.
    `replaces`: parts of the directory whose rows it holds (a merge), skipped by readers while both exist."""
    directory = Location.of(directory)
    directory.makedirs()
    name = _next_part_name()
    if replaces:
        replaced = json.dumps(sorted(replaces)).encode()
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), _REPLACES_KEY: replaced})
    final = directory / name
    final.write_atomic(lambda handle: pq.write_table(table, handle), f"{TEMP_PREFIX}{name}", fence)
    return final


def list_parts(directory: Where) -> list[Location]:
    """Visible parts in write order; temporary files are not parts."""
    return Location.of(directory).files(PART_PREFIX, PART_SUFFIX)


def is_own_part_name(name: str) -> bool:
    """Whether kvbatch names a part or its write's temporary file so; any other file is someone else's."""
    return _OWN_PART_NAME.fullmatch(name) is not None


def list_temp_files(directory: Where) -> list[Location]:
    """Temporary files of writes that never completed (or are in progress right now)."""
    return Location.of(directory).files(TEMP_PREFIX)


@dataclass(frozen=True)
class _ReadPart:
    path: Location
    table: pa.Table | None = None  # None: gone since the listing (merged away), or `problem`
    replaces: frozenset[str] = frozenset()
    problem: str | None = None


def _schema_problem(found: pa.Schema, expected: pa.Schema) -> str | None:
    """Parts written before a column was added lack it and stay readable; key columns must be there."""
    if missing := [name for name in expected.names if name not in found.names and name in KEY_COLUMNS]:
        return f"wrong schema: missing column(s) {', '.join(missing)}"
    if extra := [name for name in found.names if name not in expected.names]:
        return f"wrong schema: unexpected column(s) {', '.join(extra)}"
    for field in expected:
        if field.name not in found.names:
            continue
        actual = found.field(field.name).type
        if not actual.equals(field.type):
            return f"wrong schema: column {field.name} is {actual}, expected {field.type}"
    return None


def _read_one(path: Location, schema: pa.Schema) -> _ReadPart:
    try:
        if path.size() == 0:
            return _ReadPart(path, problem="empty file (0 bytes)")
        with path.open_input() as source:
            table = pq.ParquetFile(source).read()
    except FileNotFoundError:  # merged away by a live writer since the listing
        return _ReadPart(path)
    except (OSError, pa.ArrowException) as exc:
        return _ReadPart(path, problem=f"unreadable Parquet ({type(exc).__name__}: {exc})")
    if problem := _schema_problem(table.schema, schema):
        return _ReadPart(path, problem=problem)
    metadata = table.schema.metadata or {}
    try:
        replaces = frozenset(json.loads(metadata[_REPLACES_KEY])) if _REPLACES_KEY in metadata else frozenset()
        for field in schema:
            if field.name not in table.column_names:  # a column added since this part was written
                table = table.append_column(field, pa.nulls(table.num_rows, field.type))
        table = table.select(schema.names).cast(schema)
    except (ValueError, TypeError, pa.ArrowException) as exc:
        return _ReadPart(path, problem=f"unusable part metadata or columns ({type(exc).__name__}: {exc})")
    return _ReadPart(path, table, replaces, None)


@dataclass(frozen=True)
class PartSet:
    """What a directory holds: usable tables in write order, what they supersede, what is broken."""

    tables: list[tuple[Location, pa.Table]]
    superseded: list[Location]
    corrupt: list[CorruptPart]

    def concat(self, schema: pa.Schema) -> pa.Table:
        if not self.tables:
            return schema.empty_table()
        return pa.concat_tables([table for _, table in self.tables])


def scan_parts(directory: Where, schema: pa.Schema) -> PartSet:
    """Read every part of `directory`, sorting out superseded and corrupt ones.

    A live writer may merge parts while they are read; a merged part is published before its inputs
    go, so listing again until nothing new shows up finds the merged part of every vanished input.
    """
    read: dict[Location, _ReadPart] = {}
    for listing in range(_MAX_LISTINGS):
        new = [path for path in list_parts(directory) if path not in read]
        with ThreadPoolExecutor(_READ_THREADS) as pool:
            read.update((part.path, part) for part in pool.map(lambda path: _read_one(path, schema), new))
        replaced = set().union(*(part.replaces for part in read.values()))
        unexplained = any(p.table is None and not p.problem and p.path.name not in replaced for p in read.values())
        if not unexplained and (not new or listing >= _RESCANS):
            break
    tables, superseded, corrupt = [], [], []
    for path in sorted(read, key=lambda location: location.name):
        part = read[path]
        if part.problem is not None:
            corrupt.append(CorruptPart(path, part.problem))
        elif path.name in replaced:
            if part.table is not None:
                superseded.append(path)
        elif part.table is None:
            corrupt.append(CorruptPart(path, "removed while being read, and no part replacing it was found"))
        else:
            tables.append((path, part.table.replace_schema_metadata(None)))
    return PartSet(tables, superseded, corrupt)


def read_parts(directory: Where, schema: pa.Schema) -> tuple[pa.Table, list[CorruptPart]]:
    """All rows of `directory`'s parts in write order, and the parts that had to be skipped."""
    parts = scan_parts(directory, schema)
    return parts.concat(schema), parts.corrupt


def replace_parts(directory: Where, merged: pa.Table, obsolete: Sequence[Location], fence: Fence = no_fence) -> Location:
    """Publish `merged` (the rows of `obsolete`, in order), then delete `obsolete`; after a crash in
    between they are superseded (skipped by readers) and the next merge deletes them."""
    part = write_part(directory, merged, replaces=[path.name for path in obsolete], fence=fence)
    fence()
    _remove(obsolete)
    return part


def _remove(paths: Sequence[Location]) -> None:
    for path in paths:
        path.delete()
    if paths and paths[0].is_local:
        fsync_directory(paths[0].local_path.parent)


def merge_parts(directory: Where, schema: pa.Schema, fence: Fence = no_fence) -> Location | None:
    """Replace all of `directory`'s parts by one, keeping every row and its order; corrupt parts stay
    (still reported until someone looks). The merged part, or None when there was nothing to merge."""
    parts = scan_parts(directory, schema)
    if len(parts.tables) <= 1:
        fence()
        _remove(parts.superseded)
        return None
    return replace_parts(directory, parts.concat(schema), [path for path, _ in parts.tables] + parts.superseded, fence)
