"""Where a job folder's files live: a local folder, or a prefix on shared storage.

`s3://bucket/prefix`, `gs://bucket/prefix` and `file:///path` go through pyarrow's filesystems, so
a coordinator on any machine of a cluster (or a later one, after a crash) reads and writes the same
job. A local folder keeps POSIX durability: a file is fsynced before its rename publishes it, and
the folder is fsynced after. On an object store a write goes to a temporary key and is then moved
(a server-side copy) to its final key, so readers, who only list final names, never see half of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Union

import pyarrow.fs as pafs

from jobs.uris import filesystem_of, is_uri


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
            except (OSError, ValueError) as e:
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

    # --- reading ------------------------------------------------------------------------------

    def _info(self) -> pafs.FileInfo:
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
        with self.fs.open_input_stream(self.path) as stream:
            return stream.read()

    def open_input(self) -> pafs.NativeFile:  # type: ignore[name-defined]
        """A seekable reader (what Parquet needs)."""
        return self.fs.open_input_file(self.path)

    def files(self, prefix: str = "", suffix: str = "") -> list["Location"]:
        """Files directly in this folder whose names match, sorted by name; none if it is missing."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        names = sorted(
            info.base_name
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.File and info.base_name.startswith(prefix)
            and info.base_name.endswith(suffix)
        )
        return [self / name for name in names]

    # --- writing ------------------------------------------------------------------------------

    def makedirs(self) -> None:
        """Create the folder (object stores have no folders: nothing to do there)."""
        if self.is_local:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def delete(self) -> None:
        """Remove the file if it is there."""
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass

    def write_atomic(self, write: Callable[[BinaryIO], None], temp_name: str, fence: Fence = no_fence) -> None:
        """Publish what `write` writes as this file, whole or not at all.

        `temp_name` (a sibling name readers never list) holds the bytes until they are complete.
        `fence` is called before anything is written and again just before the publishing rename.
        """
        fence()
        temp = self.parent / temp_name
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
                with self.fs.open_output_stream(temp.path) as stream:
                    write(stream)
                fence()
                self.fs.move(temp.path, self.path)
        except BaseException:
            temp.delete()
            raise

    def write_bytes_atomic(self, data: bytes, temp_name: str, fence: Fence = no_fence) -> None:
        self.write_atomic(lambda handle: handle.write(data), temp_name, fence)


Where = Union[Location, str, os.PathLike]
"""What storage functions accept: a Location, a local path, or a storage URI."""
