"""The KV block store's page-cache opt-in (for storage-bound benchmarks): blocks leave the page cache
once written, and read back unchanged."""

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
