"""The batched tiered decode step (runner/engine/tiered_attention.py) on real tiny random models.

The references are the per-row step (each tiered row attends alone, as before) and plain
`model.generate` one prompt at a time. Every test asserts that the batched path really ran (each
cache's own count of the layers it took part in through a batched step, and the most rows it was
attended with), so none passes by running the rows one by one.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, PreTrainedModel

from jobs.kvplan import Placement
from runner.engine.kvcache import ResidentMeter, TieredCache
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.ragged import RowFailed, decode_step
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = (5, 19, 11, 30)
STEPS = 14
BLOCK = 8  # blocks seal during the prompts and again mid-decode


def _prefilled(model: PreTrainedModel, tier: str, tmp_path: Path, batched: bool,
               placements: dict[int, Placement] | None = None) -> tuple[list[TieredCache], list[int]]:
    caches, first = [], []
    for i, length in enumerate(LENGTHS):
        cache = TieredCache(model.config, tier=tier, offload_dir=tmp_path / f"{batched}-{i}", block_tokens=BLOCK,
                            placement=(placements or {}).get(i), batched_attention=batched)
        with torch.inference_mode():
            logits = model(input_ids=random_prompt(length), past_key_values=cache, use_cache=True).logits
        first.append(int(logits[0, -1].argmax()))
        caches.append(cache)
    return caches, first


def _decode(model: PreTrainedModel, caches: list[TieredCache], first: list[int]) -> list[list[int]]:
    """`STEPS` batched decode steps; each row's greedy tokens, its first (from the prefill) included."""
    tokens = [[token] for token in first]
    for step in range(STEPS):
        positions = [length + step for length in LENGTHS]
        logits = decode_step(model, [row[-1] for row in tokens], positions, caches)
        for row, token in zip(tokens, logits.argmax(dim=-1).tolist()):
            row.append(token)
    return tokens


class _Copies(TorchDispatchMode):
    """The copies dispatched on the thread that entered it: `copy_` one by one, `_foreach_copy_` batched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket.__name__ in ("copy_", "_foreach_copy_"):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _alone(model: PreTrainedModel, length: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(random_prompt(length), max_new_tokens=STEPS + 1, do_sample=False,
                             past_key_values=DynamicCache(config=model.config))
    return out[0, length:].tolist()


def _run(model: PreTrainedModel, tier: str, tmp_path: Path, batched: bool,
         placements: dict[int, Placement] | None = None) -> tuple[list[list[int]], list[TieredCache]]:
    caches, first = _prefilled(model, tier, tmp_path, batched, placements)
    try:
        return _decode(model, caches, first), caches
    finally:
        for cache in caches:
            cache.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_batched_tiered_rows_get_their_tokens_alone(tier: str, tmp_path: Path) -> None:
    """Mixed lengths, blocks sealing mid-decode: the batched step's tokens are each row's tokens
    alone (generate) and the per-row step's, and every streamed layer of every step was batched."""
    model = tiny_model("llama-gqa")
    batched, caches = _run(model, tier, tmp_path, batched=True)
    per_row, alone_caches = _run(model, tier, tmp_path, batched=False)
    assert batched == per_row == [_alone(model, length) for length in LENGTHS]
    layers = model.config.num_hidden_layers
    assert [(c.batched_layers, c.most_batched_rows) for c in caches] == [(STEPS * layers, len(LENGTHS))] * len(LENGTHS)
    assert all(c.batched_layers == 0 for c in alone_caches)  # the reference really ran per row


def test_batched_and_per_row_steps_move_the_same_bytes(tmp_path: Path) -> None:
    """The batched step reads each row's blocks and tail into its slot and writes its new token out,
    as the per-row step does: the copies' own byte counts agree, row by row."""
    model = tiny_model("llama-gqa")
    keys = ("device_to_host_bytes", "host_to_device_bytes", "decode_steps", "bytes_moved_per_decode_step",
            "offload_bytes_written", "offload_bytes_read")
    stats = {}
    for batched in (True, False):
        caches, first = _prefilled(model, "host", tmp_path, batched)
        try:
            _decode(model, caches, first)
            stats[batched] = [{key: cache.stats()[key] for key in keys} for cache in caches]
        finally:
            for cache in caches:
                cache.close()
        assert all((c.batched_layers > 0) == batched for c in caches)
    assert stats[True] == stats[False]
    assert all(row["decode_steps"] == STEPS and row["host_to_device_bytes"] > 0 for row in stats[True])


def test_a_layer_one_row_keeps_on_the_device_is_attended_row_by_row(tmp_path: Path) -> None:
    """Row 1's placement keeps layer 1 on the device: that layer goes row by row for every row, the
    other layers stay batched, and the tokens are still each row's alone."""
    model = tiny_model("llama-gqa")
    token_bytes = 2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    placement = Placement(resident_layers=(1,), host_layers=(0, 2, 3), disk_layers=(), layer_token_bytes=token_bytes,
                          tokens=max(LENGTHS) + STEPS + 1)
    got, caches = _run(model, "host", tmp_path, batched=True, placements={1: placement})
    assert got == [_alone(model, length) for length in LENGTHS]
    assert [c.batched_layers for c in caches] == [STEPS * 3] * len(LENGTHS)


def test_sliding_window_layers_stay_per_row(tmp_path: Path) -> None:
    """Qwen2 with sliding-window layers: only its full-attention layers are batched."""
    model = tiny_model("qwen2-sliding")
    full = sum(kind == "full_attention" for kind in model.config.layer_types)
    assert 0 < full < model.config.num_hidden_layers
    got, caches = _run(model, "host", tmp_path, batched=True)
    assert got == [_alone(model, length) for length in LENGTHS]
    assert [c.batched_layers for c in caches] == [STEPS * full] * len(LENGTHS)


def test_a_row_whose_blocks_are_damaged_fails_alone_by_its_own_number(tmp_path: Path) -> None:
    """Beside a pooled row (caller's row 3, the step's first), tiered row 2's block files are cut
    short between two batched steps: the step fails naming row 2 (the caller's numbering, not the
    step's 3), with the tier's own read error as the cause, so the engine fails that sequence and
    not its batch-mates."""
    model = tiny_model("llama-gqa")
    caches, first = _prefilled(model, "disk", tmp_path, batched=True)
    pool = KVPool.for_model(model.config, torch.float32, torch.device("cpu"), ResidentMeter(None, "device", ""))
    pooled = PooledCache(pool, 64)
    with torch.inference_mode():
        pooled_first = int(model(input_ids=random_prompt(7), past_key_values=pooled, use_cache=True).logits[0, -1].argmax())
    rows = [*caches[:3], pooled, caches[3]]  # the pooled row in the middle: the step reorders rows
    lengths = [*LENGTHS[:3], 7, LENGTHS[3]]
    try:
        last = decode_step(model, [*first[:3], pooled_first, first[3]], lengths, rows).argmax(dim=-1).tolist()
        assert all(c.most_batched_rows == len(LENGTHS) for c in caches) and pool.most_rows == 1  # both groups ran
        damaged = [block for block in (tmp_path / "True-2").rglob("*") if block.is_file()]  # caches[2]: row 2
        assert damaged, "the row has sealed blocks on disk"
        for block in damaged:
            block.write_bytes(b"")
        with pytest.raises(RowFailed) as failed:
            decode_step(model, last, [n + 1 for n in lengths], rows)
        assert failed.value.row == 2 and failed.value.__cause__ is not None
        assert not isinstance(failed.value.__cause__, (MemoryError, torch.OutOfMemoryError))
    finally:
        for cache in rows:
            cache.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_steps_copies_and_reads_do_not_grow_with_its_rows(tier: str, tmp_path: Path) -> None:
    """Per streamed layer, one batched copy takes every row's new token to its tail and one read job
    brings every row's next layer into its slot, one batched copy (the step's first layer adds one
    for the old tokens its rows read at the previous step's end): 2 x layers + 1 copies a step at 1
    row and at 4, none per row. Counted on the compute thread and on each row's IO thread: the
    reads run on the first row's (here only if that thread had not started the job yet), never on
    another row's, whose threads only seal blocks."""
    model = tiny_model("llama-gqa")
    layers = model.config.num_hidden_layers
    for rows in (1, len(LENGTHS)):
        caches, first = _prefilled(model, tier, tmp_path / str(rows), batched=True)
        step, positions = caches[:rows], list(LENGTHS[:rows])
        try:
            # a first step, so that the counted one starts from reads a batched step queued
            tokens = decode_step(model, first[:rows], positions, step).argmax(dim=-1).tolist()
            here, on_io = _Copies(), [_Copies() for _ in step]
            for cache, counter in zip(step, on_io):
                cache.shared.io(torch.device("cpu")).run(counter.__enter__)  # the mode is that thread's own
            with here:
                decode_step(model, tokens, [n + 1 for n in positions], step)
            for cache, counter in zip(step, on_io):
                cache.shared.io(torch.device("cpu")).run(counter.__exit__, None, None, None)
        finally:
            for cache in caches:
                cache.close()
        assert all(cache.most_batched_rows == rows for cache in step)  # the batched step ran, with every row
        assert here.ops["copy_"] == 0  # no row copied anything on its own
        assert here.ops["_foreach_copy_"] + on_io[0].ops["_foreach_copy_"] == 2 * layers + 1
        assert all(counter.ops["_foreach_copy_"] == 0 for counter in on_io[1:])


def _buffers_each_step(model, caches: list, tokens: list[int], buffers: Callable[[], list]) -> list[list]:
    """`buffers()` (the addresses of the buffers under test) after each of STEPS decode steps of the rows."""
    seen = []
    for step in range(STEPS):
        tokens = decode_step(model, tokens, [n + step for n in LENGTHS], caches).argmax(dim=-1).tolist()
        seen.append(buffers())
    return seen


def test_the_staging_buffers_are_kept_across_steps_and_go_with_the_last_row(tmp_path: Path) -> None:
    """Every batched step of the rows attends over the same two staging buffers (allocated once, not
    per step: the longest row stays within their room), which every row holds and which are freed
    once the last of those rows is closed."""
    model = tiny_model("llama-gqa")
    caches, tokens = _prefilled(model, "host", tmp_path, batched=True)
    try:
        buffers = _buffers_each_step(model, caches, tokens, lambda: [b.data_ptr() for b in caches[0].staging.buffers])
        staging = weakref.ref(caches[0].staging)
        assert all(cache.staging is staging() for cache in caches)
        assert all(cache.most_batched_rows == len(LENGTHS) for cache in caches)  # the batched step ran
    finally:
        for cache in caches:
            cache.close()
    assert len(buffers[0]) == 2 and buffers == [buffers[0]] * STEPS
    gc.collect()
    assert staging() is None


def test_a_rows_own_reads_go_into_the_same_two_buffers_every_step(tmp_path: Path) -> None:
    """Per row (no batched step), each streamed layer is read into one of the cache's two read
    buffers in turn, the same two at every step: the device allocates nothing per read."""
    model = tiny_model("llama-gqa")
    caches, tokens = _prefilled(model, "host", tmp_path, batched=False)
    try:
        buffers = _buffers_each_step(model, caches, tokens, lambda: [[b.data_ptr() for b in cache.shared.reads.buffers]
                                                                      for cache in caches])
        reads = [cache.shared.traffic.host_to_device for cache in caches]
    finally:
        for cache in caches:
            cache.close()
    assert all(n > 0 for n in reads) and all(c.batched_layers == 0 for c in caches)  # read per row, not batched
    assert all(len(pair) == 2 for pair in buffers[0]) and buffers == [buffers[0]] * STEPS
