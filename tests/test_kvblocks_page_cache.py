"""The KV block store's page-cache opt-ins (for storage-bound benchmarks): blocks leave the page cache
once written (and, kept cold, after every read too), and read back unchanged."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from storage.kvblocks import BlockCodec, KVBlockStore


def _cached_bytes(paths: list[Path]) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True)
    return sum(int(line) for line in out.stdout.split())


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_written_blocks_leave_the_page_cache_and_read_back_unchanged(compression: str, tmp_path: Path) -> None:
    store = KVBlockStore(tmp_path / "kv", BlockCodec(compression))
    store.drop_page_cache_after_writes()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(-(1 << 15), 1 << 15, size=(2, 3, 512, 64), dtype=np.int16) for _ in range(3)]
    try:
        refs = [store.append(0, blocks[0]), store.append(0, blocks[1])]
        assert np.array_equal(store.read(refs[0], np.int16).reshape(blocks[0].shape), blocks[0])  # maps the file
        refs.append(store.append(0, blocks[2]))  # drops the pages that read brought in, mapping and all
        filesystem = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True, check=False).stdout
        if shutil.which("fincore") and filesystem.strip() not in ("tmpfs", "ramfs"):
            assert _cached_bytes(store.files()) == 0
        for ref, block in zip(refs, blocks):
            out = np.empty_like(block)
            store.read_into(ref, out)
            assert np.array_equal(out, block)
    finally:
        store.close()


def _disk_read_bytes() -> int:
    """Bytes this process has made the kernel fetch from the storage device (/proc/self/io)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_kept_cold_every_read_of_a_block_comes_from_the_device(compression: str, tmp_path: Path) -> None:
    """What the cold-page-cache decode benchmark relies on: reading a block again reads the device
    again (/proc/self/io read_bytes grows by the blocks) and leaves nothing of them in the page cache."""
    filesystem = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True, check=False).stdout
    if filesystem.strip() in ("tmpfs", "ramfs") or not shutil.which("fincore"):
        pytest.skip(f"{tmp_path} is in RAM ({filesystem.strip()}) or fincore is missing: nothing to drop or check")
    store = KVBlockStore(tmp_path / "kv", BlockCodec(compression))
    store.keep_page_cache_cold()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(-(1 << 15), 1 << 15, size=(2, 3, 512, 64), dtype=np.int16) for _ in range(2)]
    try:
        refs = [store.append(0, block) for block in blocks]
        stored = sum(ref.stored_bytes for ref in refs)
        for _ in range(2):  # the second round would be served from RAM if the first had left pages behind
            # readahead may fetch the next block while reading one: per round, in file order, as a layer is read
            before = _disk_read_bytes()
            for ref, block in zip(refs, blocks):
                out = np.empty_like(block)
                assert store.read_into(ref, out) == block.nbytes
                assert np.array_equal(out, block)
            assert _disk_read_bytes() - before >= stored
            assert _cached_bytes(store.files()) == 0
            before = _disk_read_bytes()
            for ref, block in zip(refs, blocks):
                assert np.array_equal(store.read(ref, np.int16).reshape(block.shape), block)
            assert _disk_read_bytes() - before >= stored
            assert _cached_bytes(store.files()) == 0
        assert store.bytes_read == 4 * stored  # what the reads returned, counted where they return it
    finally:
        store.close()
