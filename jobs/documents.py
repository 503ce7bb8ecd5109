"""Reading one document from disk or shared storage and extracting its text (jobs.extract).

Manifest paths are hostile until proven otherwise (docs/input.md, "What is rejected, and why"): the size
limit is checked before a byte is read (on the file as read: decompressed `.gz`, expanded DOCX); only
regular files are opened (a FIFO would block forever, a device never end); never a pseudo file system's
(`/proc/self/environ` reads as the environment, credentials included); `documents_root` holds after
symlinks and `..` are resolved. URIs (s3://, file://) go through pyarrow's filesystems under the same rules.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import zlib
from pathlib import Path
from typing import BinaryIO

import pyarrow.fs as pafs

from jobs.extract import Extracted, ExtractError, clean_text, extract
from jobs.task import Task
from jobs.uris import UnsupportedURIError, filesystem_of, is_uri


class DocumentError(ValueError):
    """A document that cannot be used as input (input-class failure: never retried)."""


class DocumentTooLarge(DocumentError):
    """The document is over the byte limit it was read with."""


def text_sha256(text: str) -> str:
    """The fingerprint recorded at submit time and checked again before a task runs."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_text(what: str, text: str) -> str:
    """The text cleaned of stray control characters; refuses binary and empty text (inline texts and files)."""
    try:
        text = clean_text(text)
    except ExtractError as e:
        raise DocumentError(f"{what} {e}") from None
    if not text.strip():
        raise DocumentError(f"{what} is empty (or only whitespace): give a document with some text")
    return text


def check_size(what: str, size: int, max_bytes: int) -> None:
    """The one size rule, applied before reading (files) or before accepting (inline texts)."""
    if size > max_bytes:
        raise DocumentTooLarge(
            f"{what} is {size} bytes, over input.max_document_bytes ({max_bytes}): "
            "split the document or raise input.max_document_bytes"
        )


def _refuse_special(resolved: Path, st: os.stat_result) -> None:
    """Only a regular file, on a file system that holds files people wrote, is a document."""
    if stat.S_ISDIR(st.st_mode):
        problem = "is a directory, not a file: give the path of a document inside it"
    elif stat.S_ISFIFO(st.st_mode):
        problem = "is a FIFO (named pipe), not a regular file: write the document to a file first"
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        problem = "is a device, not a regular file: give the path of a text file"
    elif not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file (socket or other special file): give the path of a text file"
    else:
        _refuse_pseudo(resolved, st.st_dev)
        return
    raise DocumentError(f"{resolved} {problem}")


#: File systems whose files the kernel makes up as they are read (a process's environment or memory, kernel
#: state): never a document, though their files look regular.
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc", "selinuxfs", "nsfs", "mqueue",
})
#: Where Linux mounts them: refused by path too, should the mount table not be readable.
PSEUDO_ROOTS = (Path("/proc"), Path("/sys"))
MOUNT_TABLE = Path("/proc/self/mountinfo")


def _mounted_file_system(device: int) -> str | None:
    """The type of the file system mounted from `device` (st_dev), from this process's mount table."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        lines = MOUNT_TABLE.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:  # "36 35 0:21 / /proc rw,... shared:5 - proc proc rw" (proc(5))
        fields, _, after = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 2 and parts[2] == wanted and after:
            return after.split()[0]
    return None


def pseudo_file_system(resolved: Path, device: int) -> str | None:
    """The pseudo file system `resolved` (symlinks resolved) lies on, by its device `device` or its path;
    None for a file system that holds files people wrote."""
    # a pseudo file system has no block device (major 0); neither has tmpfs, NFS or overlay: look those up
    if os.major(device) == 0 and (kind := _mounted_file_system(device)) in PSEUDO_FILE_SYSTEMS:
        return kind
    return next((str(root) for root in PSEUDO_ROOTS if resolved.is_relative_to(root)), None)


def _refuse_pseudo(resolved: Path, device: int) -> None:
    if (kind := pseudo_file_system(resolved, device)) is not None:
        raise DocumentError(
            f"{resolved} is on a pseudo file system ({kind}): the kernel makes its bytes up as it is read (a "
            "process's environment, kernel state), it is no document: copy the text into a regular file"
        )


def resolve_document_path(path: Path, documents_root: Path | None) -> Path:
    """The real location of `path` (symlinks and `..` resolved), which must lie inside the root."""
    if "\x00" in str(path):
        raise DocumentError(f"path {str(path)!r} contains a NUL character: fix the path")
    try:
        resolved = path.expanduser().resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop (Python < 3.13)
        raise DocumentError(f"path {path} cannot be resolved ({e}): fix the path or the symlinks") from None
    if documents_root is not None and not resolved.is_relative_to(documents_root):
        shown = f"{path} (resolves to {resolved})" if resolved != path else str(path)
        raise DocumentError(
            f"path {shown} is outside input.documents_root {documents_root}: "
            "move the document under the root or change input.documents_root"
        )
    return resolved


def _read_limited(stream: BinaryIO, path: Path | str, max_bytes: int, compressed: bool) -> bytes:
    try:
        data = stream.read(max_bytes + 1)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DocumentError(f"file {path} is not a valid gzip file ({e}): recompress it or drop the .gz") from None
    if len(data) > max_bytes:
        what = "decompresses to" if compressed else "has grown to"
        raise DocumentTooLarge(
            f"file {path} {what} more than input.max_document_bytes ({max_bytes} bytes): "
            "split the document or raise input.max_document_bytes"
        )
    return data


def read_document(path: Path, max_bytes: int, documents_root: Path | None, rereading: bool = False) -> Extracted:
    """The text of the document at `path` (absolute; `.gz` decompressed), or DocumentError saying why not.
    `documents_root` must be resolved already. `rereading`: validated at submit, `max_bytes` is its size."""
    resolved = resolve_document_path(path, documents_root)
    try:
        st = resolved.stat()
    except FileNotFoundError:
        raise DocumentError(f"file {resolved} does not exist: fix the path or add the file") from None
    except OSError as e:
        raise DocumentError(f"file {resolved} cannot be read ({e.strerror or e}): check the path") from None
    _refuse_special(resolved, st)
    check_size_before_reading(resolved, st.st_size, max_bytes)
    try:
        # O_NONBLOCK: if the file was swapped for a FIFO since stat(), opening must not hang.
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise DocumentError(
            f"file {resolved} cannot be opened ({e.strerror or e}): check that it exists and is readable"
        ) from None
    try:
        with open(fd, "rb") as raw:
            # what was opened, should the path have been swapped since stat()
            _refuse_special(resolved, os.fstat(fd))
            return _text_of(raw, resolved, max_bytes, None if rereading else max_bytes)
    except OSError as e:
        raise DocumentError(f"file {resolved} cannot be read ({e.strerror or e}): check the disk and the file") from None


def check_size_before_reading(name: Path | str, size: int, max_bytes: int) -> None:
    """A compressed file's size says nothing of its text: its limit is applied while reading."""
    if not str(name).endswith(".gz"):
        check_size(f"file {name}", size, max_bytes)


def _text_of(raw: BinaryIO, name: Path | str, max_bytes: int, max_expanded_bytes: int | None) -> Extracted:
    """The checked text of an open document (`.gz` decompressed), read no further than the limit;
    a DOCX is expanded only when its members fit `max_expanded_bytes`."""
    if str(name).endswith(".gz"):
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            data = _read_limited(stream, name, max_bytes, compressed=True)
    else:
        data = _read_limited(raw, name, max_bytes, compressed=False)
    try:
        extracted = extract(data, str(name), max_expanded_bytes)
    except ExtractError as e:
        raise DocumentError(f"file {name} {e}") from None
    if not extracted.text.strip():
        raise DocumentError(f"file {name} is empty (or only whitespace): give a document with some text")
    return extracted


def read_uri_document(uri: str, max_bytes: int, rereading: bool = False) -> Extracted:
    """The text of a document on shared storage (s3://, file://); `rereading` as for read_document."""
    try:
        fs, path = filesystem_of(uri)
        if isinstance(fs, pafs.LocalFileSystem):  # a file:// URI: the local rules on its real path
            local = Path(path).resolve()
            if local.exists():
                _refuse_pseudo(local, local.stat().st_dev)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise DocumentError(f"{uri} does not exist: fix the URI or upload the document")
        if info.type != pafs.FileType.File:
            raise DocumentError(f"{uri} is not a file: give the URI of a document")
        check_size_before_reading(uri, info.size, max_bytes)
        with fs.open_input_stream(path) as raw:
            return _text_of(raw, uri, max_bytes, None if rereading else max_bytes)
    except DocumentError:
        raise
    except UnsupportedURIError as e:  # its message already says what to use instead
        raise DocumentError(str(e)) from None
    except (OSError, ValueError) as e:
        raise DocumentError(f"{uri} cannot be read ({e}): check the URI and the storage credentials") from None


def load_task_text(task: Task) -> str:
    """The text a task summarises; a file is re-read and must be the one validated at submit time."""
    if task.source_type == "text":
        return task.source
    path = task.source
    try:
        # The path was resolved and checked against documents_root at submit; its exact size is known.
        if is_uri(path):
            text = read_uri_document(path, max_bytes=task.n_bytes, rereading=True).text
        else:
            text = read_document(Path(path), max_bytes=task.n_bytes, documents_root=None, rereading=True).text
    except DocumentTooLarge:
        raise DocumentError(
            f"document {task.doc_id!r} ({path}) changed since the job was submitted (it is now larger "
            f"than its {task.n_bytes} bytes): restore the original file or submit a new job"
        ) from None
    except DocumentError as e:
        raise DocumentError(
            f"document {task.doc_id!r} can no longer be read: {e} (it was readable when the job was submitted)"
        ) from None
    if text_sha256(text) != task.sha256:
        raise DocumentError(
            f"document {task.doc_id!r} ({path}) changed since the job was submitted (sha256 differs): "
            "restore the original file or submit a new job"
        )
    return text
