"""What `kvbatch submit` is given: a manifest, a folder of documents, or either on shared storage.

A folder becomes a manifest of one row per file: id = the file's path relative to the folder (with
`/`), path = where it is. Hidden files and folders (names starting with `.`) are left out, and
`--glob` keeps only relative paths matching it (`fnmatch`: `*` also crosses `/`, so `*.pdf` finds
PDFs at any depth). A manifest on shared storage is copied to a local file to be read; its
relative document paths are read from beside it there.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from jobs.manifest import ManifestError
from jobs.uris import is_uri
from storage.location import Location

#: The manifest made from a folder, kept in the job folder: the job's documents stay known if the folder changes.
FOLDER_MANIFEST_NAME = "input-manifest.jsonl"


@dataclass(frozen=True)
class StagedManifest:
    path: Path  # the local manifest file to read
    shown: str  # the manifest as people name it (a URI, or the folder it was made from)
    uri_base: str | None = None  # the folder URI of a manifest on shared storage
    from_folder: bool = False  # made from a folder: kept in the job folder as FOLDER_MANIFEST_NAME


def stage_input(source: str, pattern: str | None, workdir: Path, skip: Path | None = None) -> StagedManifest:
    """A local manifest for `source` (written under `workdir` when it has to be made or fetched).

    `skip`: a folder left out of a listing (the job folder, when it lies inside the documents' folder).
    """
    if is_uri(source):
        return _stage_uri(source, pattern, workdir)
    path = Path(source).expanduser()
    if path.is_dir():
        rows = _local_rows(path, pattern, skip)
        return _write_rows(rows, source, pattern, workdir)
    if pattern is not None:
        raise ManifestError(f"--glob selects files of a folder, but {source} is not a folder: drop --glob or give a folder")
    return StagedManifest(path, source)


def _stage_uri(source: str, pattern: str | None, workdir: Path) -> StagedManifest:
    base, _, query = source.partition("?")
    try:
        location = Location.of(source)
        kind = location.fs.get_file_info(location.path).type
        if source.endswith("/") or base.endswith("/") or kind == pafs.FileType.Directory:
            return _write_rows(_uri_rows(location, base.rstrip("/"), query, pattern), source, pattern, workdir)
        if pattern is not None:
            raise ManifestError(f"--glob selects files of a folder, but {source} is a file: drop --glob or give a folder")
        if kind == pafs.FileType.NotFound:
            raise ManifestError(f"manifest {source} does not exist: check the URI")
        local = workdir / location.name
        local.write_bytes(location.read_bytes())
    except ManifestError:
        raise
    except (OSError, ValueError) as e:
        raise ManifestError(f"{source} cannot be read ({e}): check the URI and the storage credentials") from None
    return StagedManifest(local, source, uri_base=base.rsplit("/", 1)[0] + (f"?{query}" if query else ""))


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") for part in relative.split("/"))


def _selected(relative: str, pattern: str | None) -> bool:
    return not _hidden(relative) and (pattern is None or fnmatch.fnmatchcase(relative, pattern))


def _local_rows(root: Path, pattern: str | None, skip: Path | None) -> list[dict[str, str]]:
    root = root.absolute()
    skip = skip.absolute() if skip is not None else None
    rows = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and Path(folder, d) != skip)
        for name in sorted(files):
            relative = Path(folder, name).relative_to(root).as_posix()
            if _selected(relative, pattern):
                rows.append({"id": relative, "path": str(Path(folder, name))})
    return rows


def _uri_rows(folder: Location, base: str, query: str, pattern: str | None) -> list[dict[str, str]]:
    infos = folder.fs.get_file_info(pafs.FileSelector(folder.path, recursive=True, allow_not_found=True))
    rows = []
    for info in sorted(infos, key=lambda i: i.path):
        relative = info.path[len(folder.path):].lstrip("/")
        if info.type == pafs.FileType.File and _selected(relative, pattern):
            rows.append({"id": relative, "path": f"{base}/{relative}" + (f"?{query}" if query else "")})
    return rows


def _write_rows(rows: list[dict[str, str]], source: str, pattern: str | None, workdir: Path) -> StagedManifest:
    if not rows:
        matching = f" matching --glob {pattern!r}" if pattern else ""
        raise ManifestError(
            f"folder {source} has no documents{matching} (hidden files are left out): check the folder or the pattern"
        )
    path = workdir / FOLDER_MANIFEST_NAME
    # ASCII JSON: a file name that is not valid UTF-8 reaches the manifest's id checks instead of failing here
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="ascii")
    return StagedManifest(path, source, from_folder=True)
