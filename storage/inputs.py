"""What `kvbatch submit` is given: a manifest, a folder of documents, or either on shared storage.

A folder becomes a manifest of one row per file (docs/input.md, "Folders and buckets"); what it leaves
out (earlier job folders, symlinked subfolders) is named in `StagedManifest.notes`. A manifest on shared
storage is copied to a local file; its relative document paths are read from beside it there.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

from jobs.documents import pseudo_file_system
from jobs.manifest import ManifestError
from jobs.uris import is_uri
from storage.jobdir import holds_job
from storage.location import Location, StorageError

#: The manifest made from a folder, kept in the job folder: the job's documents stay known if the folder changes.
FOLDER_MANIFEST_NAME = "input-manifest.jsonl"


@dataclass(frozen=True)
class StagedManifest:
    path: Path  # the local manifest file to read
    shown: str  # the manifest as people name it (a URI, or the folder it was made from)
    uri_base: str | None = None  # the folder URI of a manifest on shared storage
    from_folder: bool = False  # made from a folder: kept in the job folder as FOLDER_MANIFEST_NAME
    notes: tuple[str, ...] = ()  # what the listing left out that a user would not expect, one line each


@dataclass
class _Listing:
    """A folder's rows, and the subfolders left out of them."""

    rows: list[dict[str, str]] = field(default_factory=list)
    job_folders: list[str] = field(default_factory=list)  # relative paths of kvbatch job folders
    links: list[str] = field(default_factory=list)  # "relative -> target" of symlinked folders

    def notes(self) -> tuple[str, ...]:
        notes = []
        if self.job_folders:
            notes.append(f"left out {len(self.job_folders)} kvbatch job folder(s): {', '.join(self.job_folders)}")
        if self.links:
            notes.append(
                f"left out {len(self.links)} symlinked folder(s), not followed: {', '.join(self.links)}; "
                "submit the target folder itself, or name its files in a manifest"
            )
        return tuple(notes)


def stage_input(source: str, pattern: str | None, workdir: Path, skip: Path | None = None) -> StagedManifest:
    """A local manifest for `source` (written under `workdir` when made or fetched); `skip`: a folder
left out of a listing (the job folder, when it lies inside the documents' folder)."""
    if is_uri(source):
        return _stage_uri(source, pattern, workdir)
    path = Path(source).expanduser()
    if path.is_dir():
        return _write_rows(_local_listing(path, source, pattern, skip), source, pattern, workdir)
    if pattern is not None:
        raise ManifestError(f"--glob selects files of a folder, but {source} is not a folder: drop --glob or give a folder")
    return StagedManifest(path, source)


def _stage_uri(source: str, pattern: str | None, workdir: Path) -> StagedManifest:
    base, _, query = source.partition("?")
    try:
        location = Location.of(source)
        kind = location.fs.get_file_info(location.path).type
        if source.endswith("/") or base.endswith("/") or kind == pafs.FileType.Directory:
            path_of = _uri_of(base, query)
            listing = (_local_listing(location.local_path, source, pattern, None, path_of)
                       if location.is_local else _uri_listing(location, source, path_of, pattern))
            return _write_rows(listing, source, pattern, workdir)
        if pattern is not None:
            raise ManifestError(f"--glob selects files of a folder, but {source} is a file: drop --glob or give a folder")
        if kind == pafs.FileType.NotFound:
            raise ManifestError(f"manifest {source} does not exist: check the URI")
        local = workdir / location.name
        local.write_bytes(location.read_bytes())
    except (ManifestError, StorageError):  # a StorageError names the URI and the fix already
        raise
    except (OSError, ValueError) as e:
        raise ManifestError(f"{source} cannot be read ({e}): check the URI and the storage credentials") from None
    return StagedManifest(local, source, uri_base=base.rsplit("/", 1)[0] + (f"?{query}" if query else ""))


def _refuse_pseudo_folder(folder: Path, source: str) -> None:
    """A folder of /proc or /sys holds no documents: the kernel makes its files up (jobs.documents)."""
    resolved = folder.resolve()
    if (kind := pseudo_file_system(resolved, resolved.stat().st_dev)) is not None:
        raise ManifestError(
            f"folder {source} is on a pseudo file system ({kind}): the kernel makes its files up as they are read, "
            "no documents: submit a folder of documents"
        )


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") for part in relative.split("/"))


def _selected(relative: str, pattern: str | None) -> bool:
    return not _hidden(relative) and (pattern is None or fnmatch.fnmatchcase(relative, pattern))


def _not_documents(source: str) -> ManifestError:
    return ManifestError(
        f"{source} is a kvbatch job folder, not a folder of documents: continue it with `kvbatch resume {source}`"
    )


def _uri_of(base: str, query: str) -> Callable[[str], str]:
    """The URI of a file of the folder `base` (a file:// folder is listed locally: pyarrow would follow links)."""
    return lambda relative: f"{base.rstrip('/')}/{relative}" + (f"?{query}" if query else "")


def _local_listing(root: Path, source: str, pattern: str | None, skip: Path | None,
                   path_of: Callable[[str], str] | None = None) -> _Listing:
    _refuse_pseudo_folder(root, source)
    root = root.absolute()
    path_of = path_of or (lambda relative: str(root / relative))
    skip = skip.absolute() if skip is not None else None
    listing = _Listing()
    for folder, dirs, files in os.walk(root):
        relative_folder = Path(folder).relative_to(root).as_posix()
        if holds_job({*dirs, *files}):
            if folder == str(root):
                raise _not_documents(source)
            listing.job_folders.append(relative_folder)
            dirs[:] = []
            continue
        kept = []
        for sub in sorted(Path(folder, d) for d in dirs if not d.startswith(".") and Path(folder, d) != skip):
            if sub.is_symlink():
                listing.links.append(f"{sub.relative_to(root).as_posix()} -> {os.readlink(sub)}")
            else:
                kept.append(sub.name)
        dirs[:] = kept
        for name in sorted(files):
            relative = Path(folder, name).relative_to(root).as_posix()
            if _selected(relative, pattern):
                listing.rows.append({"id": relative, "path": path_of(relative)})
    return listing


def _uri_listing(folder: Location, source: str, path_of: Callable[[str], str], pattern: str | None) -> _Listing:
    infos = folder.fs.get_file_info(pafs.FileSelector(folder.path, recursive=True, allow_not_found=True))
    files = sorted(info.path[len(folder.path):].lstrip("/") for info in infos if info.type == pafs.FileType.File)
    names_in: dict[str, set[str]] = {}  # folder (relative, "" for the top) -> the names directly in it
    for relative in files:
        parts = relative.split("/")
        for depth in range(len(parts)):
            names_in.setdefault("/".join(parts[:depth]), set()).add(parts[depth])
    job_folders = sorted(name for name, names in names_in.items() if holds_job(names))
    if "" in job_folders:
        raise _not_documents(source)
    outermost = [f for f in job_folders if not _hidden(f) and not any(f.startswith(f"{o}/") for o in job_folders)]
    listing = _Listing(job_folders=outermost)
    for relative in files:
        if _selected(relative, pattern) and not any(relative.startswith(f"{f}/") for f in outermost):
            listing.rows.append({"id": relative, "path": path_of(relative)})
    return listing


def _write_rows(listing: _Listing, source: str, pattern: str | None, workdir: Path) -> StagedManifest:
    if not listing.rows:
        matching = f" matching --glob {pattern!r}" if pattern else ""
        left_out = "; ".join(("hidden files are left out", *listing.notes()))
        raise ManifestError(f"folder {source} has no documents{matching} ({left_out}): check the folder or the pattern")
    path = workdir / FOLDER_MANIFEST_NAME
    # ASCII JSON: a file name that is not valid UTF-8 reaches the manifest's id checks instead of failing here
    path.write_text("".join(json.dumps(row) + "\n" for row in listing.rows), encoding="ascii")
    return StagedManifest(path, source, from_folder=True, notes=listing.notes())
