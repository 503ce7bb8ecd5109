"""The streamed layer's host tail: token-major, a token's keys and values side by side, so the bytes
one decode step writes are one contiguous run (on CUDA: one asynchronous copy into pinned memory, no
pageable temporary)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.engine.kvcache.io_thread import IOThread
from runner.engine.kvcache.layer_store import LayerStore, Traffic, read_all
from runner.engine.kvcache.tiers import DiskTier, HostTier
from storage.kvblocks import BlockCodec

BATCH, HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 4


def _kv(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, HEADS, tokens, HEAD_DIM, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_tokens_window_is_one_contiguous_run_of_the_tail_and_lands_byte_exact(dtype: torch.dtype) -> None:
    io = IOThread(torch.device("cpu"))
    store = LayerStore(0, _kv(1, dtype, 0), HostTier(), io, BLOCK, Traffic())
    keys, values = _kv(2, dtype, 1), _kv(2, dtype, 2)  # a prompt of two tokens, then one decode token
    store.append(keys, values)
    step_keys, step_values = _kv(1, dtype, 3), _kv(1, dtype, 4)
    written = store.append(step_keys, step_values)
    assert store.tail_len == 3 and written == 2 * BATCH * HEADS * HEAD_DIM * dtype.itemsize
    token_bytes = 2 * BATCH * HEADS * HEAD_DIM * dtype.itemsize  # keys and values of every row and head
    window = store.tail[2:3]
    assert window.is_contiguous()
    flat = store.tail.view(torch.uint8).reshape(-1)
    # the decode token's keys of every row and head, then its values: bytes 2*token_bytes..3*token_bytes, in order
    new = torch.cat([step_keys.contiguous().view(torch.uint8).reshape(-1), step_values.contiguous().view(torch.uint8).reshape(-1)])
    assert torch.equal(flat[2 * token_bytes : 3 * token_bytes], new)
    for i, kv in enumerate((step_keys, step_values)):
        assert torch.equal(window[:, i].view(torch.uint8), kv.permute(2, 0, 1, 3).contiguous().view(torch.uint8))
    io.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_sealed_blocks_and_tail_read_back_bit_exact_after_reorder_and_crop(tier: str, tmp_path: Path) -> None:
    dtype = torch.bfloat16
    io = IOThread(torch.device("cpu"))
    store_tier = HostTier() if tier == "host" else DiskTier(tmp_path, BlockCodec("zstd", 1, True))
    store = LayerStore(0, _kv(1, dtype, 0), store_tier, io, BLOCK, Traffic())
    keys, values = _kv(6, dtype, 5), _kv(6, dtype, 6)  # one sealed block of 4 and a tail of 2
    store.append(keys, values)
    for step in range(3):  # fills the tail, seals it, starts another
        k, v = _kv(1, dtype, 10 + step), _kv(1, dtype, 20 + step)
        store.append(k, v)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
    resident = store.load(extra_tokens=1)
    assert resident.length == 9 and len(store.blocks) == 2 and store.tail_len == 1
    assert torch.equal(resident.keys[:, :, :9].view(torch.int16), keys.view(torch.int16))
    assert torch.equal(resident.values[:, :, :9].view(torch.int16), values.view(torch.int16))
    rows = torch.tensor([2, 0, 0])
    store.select_rows(rows)
    store.crop(3)  # 6 tokens left: the second block cut in two comes back as the tail
    resident = store.load(extra_tokens=0)
    assert store.tail_len == 2 and resident.length == 6
    assert torch.equal(resident.keys.view(torch.int16), keys[rows, :, :6].view(torch.int16))
    assert torch.equal(resident.values.view(torch.int16), values[rows, :, :6].view(torch.int16))
    io.close()
    store_tier.close()


def test_one_read_job_serves_several_rows_and_a_bad_row_fails_alone(tmp_path: Path) -> None:
    """`read_all` reads three stores' layers (host blocks, disk blocks, a damaged disk block) in one
    job with one batched copy: the good ones land bit-exact and count their own bytes, the damaged
    one's error is on its own future only, and a read cancelled before the job ran is skipped."""
    dtype = torch.bfloat16
    io = IOThread(torch.device("cpu"))
    tiers = [HostTier(), DiskTier(tmp_path / "good", BlockCodec("zstd", 1, True)),
             DiskTier(tmp_path / "bad", BlockCodec("zstd", 1, True)), HostTier()]
    stores, expected = [], []
    for i, tier in enumerate(tiers):
        store = LayerStore(0, _kv(1, dtype, 0), tier, io, BLOCK, Traffic())
        keys, values = _kv(6, dtype, 30 + i), _kv(6, dtype, 40 + i)  # a sealed block and a tail of 2
        store.append(keys, values)
        stores.append(store)
        expected.append((keys, values))
    io.run(lambda: None)  # the blocks are sealed
    for block in (tmp_path / "bad").rglob("*"):
        if block.is_file():
            block.write_bytes(b"")
    reads = [store.read_later(extra_tokens=1) for store in stores]
    assert reads[3].done.cancel()
    read_all(reads)
    for store, read, (keys, values) in zip(stores[:2], reads[:2], expected[:2]):
        resident = read.done.result()
        assert resident.length == 6 and resident.capacity == 7
        assert torch.equal(resident.keys[:, :, :6].view(torch.int16), keys.view(torch.int16))
        assert torch.equal(resident.values[:, :, :6].view(torch.int16), values.view(torch.int16))
        assert store.traffic.host_to_device == resident.copied_bytes == 6 * store.token_bytes
    assert reads[2].done.exception() is not None and stores[2].traffic.host_to_device == 0
    assert reads[3].done.cancelled() and stores[3].traffic.host_to_device == 0
    io.close()
    for tier in tiers:
        tier.close()
