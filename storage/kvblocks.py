"""KV block files: the codec (byte-plane shuffle + zstd) and one task's append-only block store.

The shuffle puts the floats' barely varying high bytes (sign, exponent) side by side, where zstd finds
them alike (docs/kv-cache.md, "Tiered-disk blocks"). Numpy and bytes only: no torch here. Each layer has one
append-only file; a `BlockRef` says where a block lies; `compression: none` blocks are read through mmap.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import zstandard

Compression = Literal["zstd", "none"]
COMPRESSIONS: tuple[str, ...] = ("zstd", "none")


class KVBlockError(RuntimeError):
    """A block file that cannot be written or read back; the message names the file."""


def shuffle_planes(values: np.ndarray) -> np.ndarray:
    """The bytes of `values` as planes, shape (itemsize, n): row i holds byte i of every value."""
    flat = np.ascontiguousarray(values).reshape(-1)
    columns = flat.view(np.uint8).reshape(-1, flat.dtype.itemsize)
    planes = np.empty(columns.shape[::-1], dtype=np.uint8)
    for i, plane in enumerate(planes):  # column copies: several times faster than a transposed copy
        plane[:] = columns[:, i]
    return planes


def unshuffle_planes(planes: list[np.ndarray] | np.ndarray, out: np.ndarray) -> np.ndarray:
    """Inverse of `shuffle_planes`, written into `out` (any strides, last axis contiguous): the
    values in C order, so `out` can be a slice of the final buffer and no copy follows."""
    width = out.dtype.itemsize
    if len(planes) != width or any(plane.size != out.size for plane in planes):
        raise KVBlockError(
            f"{len(planes)} byte planes of sizes {[p.size for p in planes]} do not fill "
            f"{out.size} values of {width} bytes"
        )
    if out.ndim == 0 or (out.shape[-1] > 1 and out.strides[-1] != width):
        raise KVBlockError("the destination of a decoded block needs a contiguous last axis")
    as_bytes = out.view(np.uint8)  # (..., last * width): byte j of value k at [..., k * width + j]
    for i, plane in enumerate(planes):
        as_bytes[..., i::width] = plane.reshape(out.shape)
    return out


_PLANE_LENGTH = np.dtype("<u4")


@dataclass(frozen=True)
class BlockCodec:
    """How a block's bytes are stored: zstd at `level` after an optional shuffle, or raw.

    Shuffled, each byte plane is its own zstd frame with its own entropy tables (SmolLM2's bf16 KV: 1.36x
    with one frame, 1.46x a frame per plane). Payload: the frame lengths (uint32 per plane), then the frames.
    """

    compression: Compression = "zstd"
    level: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"cache.compression must be one of {COMPRESSIONS}, got {self.compression!r}")

    def encode(self, values: np.ndarray) -> bytes:
        if self.compression == "none":
            return np.ascontiguousarray(values).tobytes()
        compressor = _zstd.compressor(self.level)
        if not self.shuffle:
            return compressor.compress(np.ascontiguousarray(values))
        frames = [compressor.compress(plane) for plane in shuffle_planes(values)]
        lengths = np.array([len(f) for f in frames], dtype=_PLANE_LENGTH)
        return b"".join([lengths.tobytes(), *frames])

    def decode(self, payload: bytes | memoryview, dtype: np.dtype) -> np.ndarray:
        """A flat array of `dtype`; for `none` a zero-copy view of `payload`."""
        dtype = np.dtype(dtype)
        if self.compression == "none":
            return np.frombuffer(payload, dtype=dtype)
        if not self.shuffle:
            return np.frombuffer(_zstd.decompressor.decompress(payload), dtype=dtype)
        planes = self._planes(payload, dtype.itemsize)
        return unshuffle_planes(planes, np.empty(planes[0].size, dtype=dtype))

    def decode_into(self, payload: bytes | memoryview, out: np.ndarray) -> None:
        """Decode a block straight into `out` (e.g. its window of the layer's buffer)."""
        if self.compression == "zstd" and self.shuffle:
            unshuffle_planes(self._planes(payload, out.dtype.itemsize), out)
        else:
            out[...] = self.decode(payload, out.dtype).reshape(out.shape)

    @staticmethod
    def _planes(payload: bytes | memoryview, width: int) -> list[np.ndarray]:
        header = width * _PLANE_LENGTH.itemsize
        lengths = np.frombuffer(payload[:header], dtype=_PLANE_LENGTH)
        ends = header + np.cumsum(lengths)
        return [
            np.frombuffer(_zstd.decompressor.decompress(payload[s:e]), dtype=np.uint8)
            for s, e in zip(ends - lengths, ends)
        ]


class _ZstdContexts(threading.local):
    """zstd (de)compressor objects are not thread-safe: one set per thread, reused."""

    def __init__(self) -> None:
        self.decompressor = zstandard.ZstdDecompressor()
        self.compressor = functools.cache(lambda level: zstandard.ZstdCompressor(level=level))


_zstd = _ZstdContexts()


@dataclass(frozen=True)
class BlockRef:
    """Where one encoded block lies in its layer file."""

    layer: int
    offset: int
    stored_bytes: int
    raw_bytes: int


class _LayerFile:
    """One layer's append-only file; mapped for reading when blocks are stored raw."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise KVBlockError(f"cannot create KV block file {path}: {e.strerror}") from None
        self.size = 0
        self._map: mmap.mmap | None = None

    def append(self, payload: bytes) -> int:
        offset = self.size
        rest = memoryview(payload)
        while rest:  # a short write (a disk filling up) is continued, so the real ENOSPC OSError surfaces
            rest = rest[os.pwrite(self.fd, rest, offset + len(payload) - len(rest)) :]
        self.size += len(payload)
        return offset

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise KVBlockError(f"KV block file {self.path} is truncated at offset {offset}: read {len(data)} of {length}")
        return data

    def view(self, offset: int, length: int) -> memoryview:
        if self._map is None or len(self._map) < offset + length:
            # A grown file needs a new mapping; the old one closes when its last view is dropped.
            # Copy-on-write so numpy (and torch) get a writable view; nothing is ever written back.
            self._map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_COPY)
        return memoryview(self._map)[offset : offset + length]

    def truncate(self, size: int) -> None:
        self._map = None
        os.ftruncate(self.fd, size)
        self.size = size

    def drop_cached_pages(self) -> None:
        """Flush the file and ask the kernel to forget its cached pages (dirty and still-mapped pages
        would stay), so the next read of any block goes to the device."""
        self._map = None
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def drop_cached_range(self, offset: int, length: int) -> None:
        """Forget the cached pages of one block just read (widened to whole pages), mapped or not, so
        its next read goes to the device again. Only clean pages go: blocks are flushed when written."""
        start = offset - offset % mmap.PAGESIZE
        end = min(-(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE, self.size)
        mapped_end = min(end, len(self._map)) if self._map is not None else start
        if mapped_end > start:  # unmap them first: fadvise cannot drop mapped pages
            self._map.madvise(mmap.MADV_DONTNEED, start, mapped_end - start)  # type: ignore[union-attr]
        os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._map = None
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class KVBlockStore:
    """One task's KV blocks on disk: a file per layer in `directory`, removed by `close()`."""

    def __init__(self, directory: str | Path, codec: BlockCodec) -> None:
        self.directory = Path(directory)
        self.codec = codec
        self._created_dir = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KVBlockError(f"cannot create KV offload dir {self.directory}: {e.strerror}") from None
        self._files: dict[int, _LayerFile] = {}
        self.raw_bytes_written = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.read_s = 0.0  # time spent reading and decoding blocks, on whichever thread read them
        self._drop_page_cache = False
        self._drop_after_reads = False

    def drop_page_cache_after_writes(self) -> None:
        """Opt-in for benchmarks of the storage-bound case: after each block is written its file is
        flushed and dropped from the page cache, so reads come from the device, not RAM."""
        if not hasattr(os, "posix_fadvise"):
            raise KVBlockError("dropping the page cache needs os.posix_fadvise, which this platform lacks")
        self._drop_page_cache = True

    def keep_page_cache_cold(self) -> None:
        """Opt-in for benchmarks of a cache larger than RAM: blocks leave the page cache once written
        and again after every read, so each decode step reads its blocks from the device."""
        self.drop_page_cache_after_writes()
        self._drop_after_reads = True

    def _file(self, layer: int) -> _LayerFile:
        if layer not in self._files:
            self._files[layer] = _LayerFile(self.directory / f"layer-{layer:03d}.kvblocks")
        return self._files[layer]

    def append(self, layer: int, values: np.ndarray) -> BlockRef:
        """Encode `values` (any shape, contiguous) and append it to the layer's file."""
        payload = self.codec.encode(values)
        file = self._file(layer)
        offset = file.append(payload)
        if self._drop_page_cache:
            file.drop_cached_pages()
        self.raw_bytes_written += values.nbytes
        self.bytes_written += len(payload)
        return BlockRef(layer, offset, len(payload), values.nbytes)

    def _payload(self, ref: BlockRef) -> bytes | memoryview:
        file = self._file(ref.layer)
        if self.codec.compression == "none":
            payload: bytes | memoryview = file.view(ref.offset, ref.stored_bytes)
        else:
            payload = file.read(ref.offset, ref.stored_bytes)
        self.bytes_read += len(payload)  # what the read or the mapping handed over
        return payload

    def _after_read(self, ref: BlockRef, started: float) -> None:
        if self._drop_after_reads:
            self._file(ref.layer).drop_cached_range(ref.offset, ref.stored_bytes)
        self.read_s += time.perf_counter() - started

    def _check_size(self, ref: BlockRef, nbytes: int) -> None:
        if nbytes != ref.raw_bytes:
            raise KVBlockError(
                f"KV block at {self._file(ref.layer).path}:{ref.offset} holds {ref.raw_bytes} bytes, "
                f"not the {nbytes} asked for"
            )

    def read(self, ref: BlockRef, dtype: np.dtype) -> np.ndarray:
        """The block's values, flat (for `none` a view of the mapping; a copy when reads are kept cold)."""
        start = time.perf_counter()
        values = self.codec.decode(self._payload(ref), dtype)
        self._check_size(ref, values.nbytes)
        if self._drop_after_reads and self.codec.compression == "none":
            values = values.copy()
        self._after_read(ref, start)
        return values

    def read_into(self, ref: BlockRef, out: np.ndarray) -> int:
        """Decode the block straight into `out` (the shape it was appended with); returns the bytes written."""
        start = time.perf_counter()
        self._check_size(ref, out.nbytes)
        self.codec.decode_into(self._payload(ref), out)
        self._after_read(ref, start)
        return out.nbytes

    def truncate(self, ref: BlockRef) -> None:
        """Drop `ref` and every block appended after it in the same layer."""
        self._file(ref.layer).truncate(ref.offset)

    @property
    def compression_ratio(self) -> float | None:
        return self.raw_bytes_written / self.bytes_written if self.bytes_written else None

    def files(self) -> list[Path]:
        return [f.path for f in self._files.values()]

    def close(self) -> None:
        """Remove the block files (and the directory when this store created it)."""
        for file in self._files.values():
            file.close()
        self._files.clear()
        if self._created_dir:
            with suppress(OSError):  # something else lives there now; it is not ours to remove
                self.directory.rmdir()
