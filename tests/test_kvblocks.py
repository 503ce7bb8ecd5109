"""The KV block codec and store: lossless for every width, smaller with the shuffle, mmap for raw."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from storage.kvblocks import BlockCodec, KVBlockError, KVBlockStore, shuffle_planes, unshuffle_planes

CODECS = [BlockCodec("zstd", 1, True), BlockCodec("zstd", 3, False), BlockCodec("none")]
WIDTHS = [np.uint8, np.int16, np.float16, np.float32, np.int32]


@settings(max_examples=60, deadline=None)
@given(values=st.sampled_from(WIDTHS).flatmap(lambda dt: arrays(dt, st.integers(0, 300))),
       codec=st.sampled_from(CODECS))
def test_codec_roundtrip_is_bit_exact(values: np.ndarray, codec: BlockCodec) -> None:
    back = codec.decode(codec.encode(values), values.dtype)
    assert back.dtype == values.dtype
    assert back.view(np.uint8).tobytes() == values.view(np.uint8).tobytes()  # NaN payloads, -0.0 included


def test_shuffle_puts_each_byte_in_its_plane() -> None:
    values = np.array([0x1122, 0x3344], dtype="<u2")
    planes = shuffle_planes(values)
    assert planes.tolist() == [[0x22, 0x44], [0x11, 0x33]]
    assert unshuffle_planes(list(planes), np.empty(2, dtype="<u2")).tolist() == [0x1122, 0x3344]


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_a_strided_window_of_a_bigger_buffer(codec: BlockCodec) -> None:
    """The disk tier decodes each block straight into its window of the layer's (batch, heads, seq, dim) buffer."""
    block = _kv_like(2 * 3 * 16).reshape(2, 3, 16, 64)
    layer = np.zeros((2, 3, 40, 64), dtype=np.float16)
    codec.decode_into(codec.encode(block), layer[:, :, 16:32])
    assert np.array_equal(layer[:, :, 16:32], block)
    assert not layer[:, :, :16].any() and not layer[:, :, 32:].any()


def _kv_like(n: int) -> np.ndarray:
    """float16 values of similar magnitude per channel, as attention keys and values are."""
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.5, 4.0, size=64)
    return (rng.standard_normal((n, 64)) * scale).astype(np.float16)


def test_shuffle_compresses_float_data_better_than_plain_zstd() -> None:
    values = _kv_like(2048)
    shuffled = len(BlockCodec("zstd", 1, True).encode(values))
    plain = len(BlockCodec("zstd", 1, False).encode(values))
    assert shuffled < plain < values.nbytes


def test_store_appends_reads_truncates_and_cleans_up(tmp_path: Path) -> None:
    directory = tmp_path / "task-1.0"
    store = KVBlockStore(directory, BlockCodec("zstd", 1, True))
    blocks = [_kv_like(512) for _ in range(3)]
    refs = [store.append(layer, blocks[i]) for i, layer in enumerate([0, 0, 1])]
    assert refs[1].offset == refs[0].stored_bytes  # appended, not rewritten
    for ref, block in zip(refs, blocks):
        assert np.array_equal(store.read(ref, np.float16), block.reshape(-1))
    assert store.raw_bytes_written == sum(b.nbytes for b in blocks)
    assert store.compression_ratio and store.compression_ratio > 1.0
    assert sorted(p.name for p in directory.iterdir()) == ["layer-000.kvblocks", "layer-001.kvblocks"]
    store.truncate(refs[1])
    assert (directory / "layer-000.kvblocks").stat().st_size == refs[0].stored_bytes
    assert store.bytes_read == sum(r.stored_bytes for r in refs)
    store.close()
    assert not directory.exists()


def test_raw_blocks_are_read_through_mmap_and_survive_growth(tmp_path: Path) -> None:
    store = KVBlockStore(tmp_path / "raw", BlockCodec("none"))
    first = store.append(0, _kv_like(64))
    view = store.read(first, np.float16)
    assert view.base is not None  # a view of the mapping, not a decoded copy
    second = store.append(0, _kv_like(128))  # the file grows: a new mapping is made for it
    assert np.array_equal(store.read(second, np.float16), _kv_like(128).reshape(-1))
    assert np.array_equal(view, _kv_like(64).reshape(-1))  # the old view stays valid
    assert store.compression_ratio == 1.0
    store.close()


def test_store_keeps_a_directory_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "owner").write_text("host pid start")
    store = KVBlockStore(tmp_path, BlockCodec())
    store.append(0, _kv_like(8))
    store.close()
    assert [p.name for p in tmp_path.iterdir()] == ["owner"]


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    store = KVBlockStore(tmp_path / "kv", BlockCodec())
    ref = store.append(3, _kv_like(256))
    (tmp_path / "kv" / "layer-003.kvblocks").write_bytes(b"")
    with pytest.raises(KVBlockError, match="layer-003.kvblocks"):
        store.read(ref, np.float16)
    store.close()


def test_unknown_compression_is_rejected() -> None:
    with pytest.raises(ValueError, match="cache.compression"):
        BlockCodec("lz4")  # type: ignore[arg-type]
