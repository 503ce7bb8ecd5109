"""Where a job folder's files live: a local folder, or a prefix on shared storage (gs:// is refused).

A local file is fsynced before its rename publishes it, and the folder after; on an object store a write
goes to a temporary key, then to its final one, which is all readers list (docs/cluster.md, "Job folders
on S3").
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Union

import pyarrow.fs as pafs

from jobs.uris import S3_ENDPOINT_ENV, UnsupportedURIError, filesystem_of, is_uri


class StorageError(OSError):
    """A storage problem the user fixes (bucket, credentials, endpoint): one line naming the URI and the fix."""


_CREDENTIAL_SOURCES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                       "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "GOOGLE_APPLICATION_CREDENTIALS")
#: Error spellings of pyarrow (AWS SDK), botocore and GCS, and what the user does about each.
_USER_FIXABLE = (
    (re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|bucket does not exist", re.I), "missing bucket"),
    (re.compile(r"ACCESS_DENIED|AccessDenied|INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SIGNATURE_DOES_NOT_MATCH|"
                r"SignatureDoesNotMatch|EXPIRED_TOKEN|ExpiredToken|HTTP status 40[13]|PermissionDenied|"
                r"Unable to locate credentials|NoCredentialsError", re.I), "access denied"),
    (re.compile(r"NETWORK_CONNECTION|Could not connect|Couldn't resolve host|Could not resolve host|"
                r"Connection refused|EndpointConnectionError|curlCode: (6|7|28)\b", re.I), "unreachable"),
)


def storage_error(uri: str, error: BaseException) -> StorageError | None:
    """The one-line StorageError for `error` on `uri` when the user can fix its cause, else None."""
    text = str(error)
    kind = next((kind for pattern, kind in _USER_FIXABLE if pattern.search(text)), None)
    if kind == "missing bucket":
        bucket = uri.split("://", 1)[-1].split("/", 1)[0]
        return StorageError(f"{uri}: bucket {bucket} does not exist: create it, or fix the bucket name in the URI")
    if kind == "access denied":
        found = "" if any(os.environ.get(k) for k in _CREDENTIAL_SOURCES) else " (none are set in this environment)"
        return StorageError(
            f"{uri}: access denied: check the credentials{found} (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE) and that they have permission to read and write this bucket"
        )
    if kind == "unreachable":
        endpoint = next((os.environ[k] for k in S3_ENDPOINT_ENV if os.environ.get(k)), None)
        where = f"the storage endpoint {endpoint}" if endpoint else "the storage service"
        return StorageError(f"{uri}: cannot reach {where}: check the network, or the endpoint setting (AWS_ENDPOINT_URL)")
    return None


Fence = Callable[[], None]
"""Called before each step that makes a write visible; raises when this writer may no longer write
(a coordinator that lost its job lease)."""


def no_fence() -> None:
    """The fence of a writer that cannot lose its right to write."""


def fsync_directory(directory: Path) -> None:
    """Make renames and unlinks in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Location:
    """A file or folder: the filesystem, its path there, and the name people use for it (`uri`)."""

    fs: pafs.FileSystem = field(compare=False, repr=False)
    path: str
    uri: str

    @staticmethod
    def of(where: "Where") -> "Location":
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        if is_uri(text):
            try:
                fs, path = filesystem_of(text)
            except UnsupportedURIError as e:
                raise StorageError(str(e)) from None
            except (OSError, ValueError) as e:
                if isinstance(e, OSError) and (fixable := storage_error(text, e)) is not None:
                    raise fixable from None
                raise ValueError(f"{text}: not a usable storage URI ({e})") from None
            return Location(fs, path.rstrip("/"), text.rstrip("/"))
        return Location(pafs.LocalFileSystem(), str(Path(text).absolute()), text)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def local_path(self) -> Path:
        """The local path (only for local locations: flock, scratch dirs and such need one)."""
        if not self.is_local:
            raise ValueError(f"{self.uri} is on shared storage, not a local path")
        return Path(self.path)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        return Location(self.fs, self.path.rsplit("/", 1)[0], self.uri.rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> "Location":
        return Location(self.fs, f"{self.path}/{name}", f"{self.uri.rstrip('/')}/{name}")

    def __str__(self) -> str:
        return self.uri

    @contextmanager
    def _user_errors(self) -> Iterator[None]:
        """Storage errors the user can fix become one-line StorageErrors (other errors pass unchanged)."""
        try:
            yield
        except (FileNotFoundError, StorageError):
            raise
        except OSError as e:
            if (fixable := None if self.is_local else storage_error(self.uri, e)) is None:
                raise
            raise fixable from e

    def _info(self) -> pafs.FileInfo:
        with self._user_errors():
            return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self._info().type == pafs.FileType.Directory

    def size(self) -> int:
        """Bytes in the file; FileNotFoundError when it is gone."""
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(self.uri)
        return info.size

    def read_bytes(self) -> bytes:
        with self._user_errors(), self.fs.open_input_stream(self.path) as stream:
            return stream.read()

    def open_input(self) -> pafs.NativeFile:  # type: ignore[name-defined]
        """A seekable reader (what Parquet needs)."""
        with self._user_errors():
            return self.fs.open_input_file(self.path)

    def _names(self, kind: pafs.FileType) -> list[str]:
        """Sorted names of the entries of `kind` directly in this folder; none if it is missing."""
        with self._user_errors():
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted(info.base_name for info in infos if info.type == kind)

    def files(self, prefix: str = "", suffix: str = "") -> list["Location"]:
        """Files directly in this folder whose names match, sorted by name; none if it is missing."""
        names = self._names(pafs.FileType.File)
        return [self / name for name in names if name.startswith(prefix) and name.endswith(suffix)]

    def folders(self) -> list[str]:
        """Sorted names of the folders directly in this one (on an object store: key prefixes); none if missing."""
        return self._names(pafs.FileType.Directory)

    def makedirs(self) -> None:
        """Create the folder (object stores have no folders: nothing to do there)."""
        if self.is_local:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def delete(self) -> None:
        """Remove the file if it is there."""
        with suppress(FileNotFoundError), self._user_errors():
            self.fs.delete_file(self.path)

    def write_atomic(self, write: Callable[[BinaryIO], None], temp_name: str | None = None,
                     fence: Fence = no_fence) -> None:
        """Publish what `write` writes as this file, whole or not at all: the bytes wait under `temp_name` (a
        sibling name readers never list; random by default). `fence` is called first and before the rename."""
        fence()
        temp = self.parent / (temp_name or f".{self.name}.{secrets.token_hex(4)}.tmp")
        try:
            if self.is_local:
                with open(temp.path, "wb") as handle:
                    write(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                fence()
                os.rename(temp.path, self.path)
                fsync_directory(Path(self.path).parent)
            else:
                with self._user_errors():
                    with self.fs.open_output_stream(temp.path) as stream:
                        write(stream)
                    fence()
                    self.fs.move(temp.path, self.path)
        except BaseException:
            with suppress(OSError):  # the store that failed the write may fail this too: the write's error counts
                temp.delete()
            raise

    def write_bytes_atomic(self, data: bytes, temp_name: str | None = None, fence: Fence = no_fence) -> None:
        self.write_atomic(lambda handle: handle.write(data), temp_name, fence)


Where = Union[Location, str, os.PathLike]
"""What storage functions accept: a Location, a local path, or a storage URI."""
