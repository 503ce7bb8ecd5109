"""The worker's KV pool lives as long as the worker, and what a captured step was captured over is
keyed by the pool's generation (issue 48).

- a planned pool (the worker's on CUDA) is made once at start and kept: three waves of documents
  through the engine allocate no buffers after it, with the tokens a fresh pool per wave gives;
- an empty pool gives its room to a tiered cache;
- a pool made again at the very same address with another shape is a new generation: what the static
  step recorded for the old buffers (a graph, or a failed capture) is not used for the new ones;
- a capture that fails (a real one: no CUDA here; or one KVBATCH_FAULTS' `capture` rule injects) is
  logged once and its steps run eagerly with the same tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from jobs.config import CacheConfig, LoopStopConfig, SummarizeConfig
from jobs.faults import FAULTS_ENV
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.kvcache import KVBudgetExceeded, ResidentMeter, build_cache
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.static_step import StaticStep
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, as_loaded_model, run_batch, tokens_alone
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WAVES = [[(30 + 13 * i + 7 * wave) % 120 + 8 for i in range(6)] for wave in range(3)]
"""Three waves of six prompts of mixed lengths (8 to 127 tokens)."""
NEW = [9, 14, 6, 12, 10, 7]
PLANNED = (4, 192)
"""Four sequences of up to 192 tokens: every prompt of the waves with its summary."""


def _engine(model, tokenizer, pool: KVPool, graphs: bool = False) -> tuple[BatchEngine, StaticStep]:
    static = StaticStep(model, pool, graphs=graphs)
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN, loop_stop={"enabled": False}),
                         "auto", PLANNED[0], BIG, _is_memory_error, static=static)
    return engine, static


def _waves(model, tokenizer, pool: KVPool, tmp_path: Path, engine: BatchEngine | None = None
           ) -> tuple[list, StaticStep]:
    if engine is None:
        engine, _ = _engine(model, tokenizer, pool)
    assert engine.static is not None
    try:
        got = []
        for wave, lengths in enumerate(WAVES):
            prompts = [random_prompt(n)[0].tolist() for n in lengths]
            got.append([g.tokens for g in run_batch(engine, model, "dynamic", tmp_path / str(wave), prompts, NEW,
                                                    kv_pool=pool)])
            assert not pool.owners  # the wave is over: every slot given back
    finally:
        engine.close()
    return got, engine.static


def _pool(model, planned: tuple[int, int] | None) -> KVPool:
    return KVPool.for_model(model.config, torch.float32, torch.device("cpu"), ResidentMeter(None, "the test's device", ""),
                            planned)


def test_a_planned_pool_is_made_once_for_three_waves_with_the_tokens_of_a_pool_made_per_wave(
        tokenizer, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    unplanned = _pool(model, None)
    fresh, _ = _waves(model, tokenizer, unplanned, tmp_path / "fresh")
    assert unplanned.keys is None and unplanned.generation >= 3  # freed after each wave, made again for the next

    pool = _pool(model, PLANNED)
    pool.reserve()  # the worker's start
    assert pool.generation == 1 and (pool.slots, pool.tokens) == PLANNED
    held = pool.meter.total
    kept, static = _waves(model, tokenizer, pool, tmp_path / "kept")
    assert pool.generation == 1, "the planned pool was made again"
    assert pool.meter.total == held == pool.bytes_for(*PLANNED) and pool.keys is not None
    assert static.steps > 0 and pool.most_rows == PLANNED[0]
    assert kept == fresh  # slots reused with a wave's old KV in them: masked, never read


def test_an_empty_pool_gives_its_room_to_a_tiered_cache(tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    pool = _pool(model, PLANNED)
    pool.reserve()
    held = PooledCache(pool, 64)
    tiered = build_cache("tiered-host", model, CacheConfig(block_tokens=8), tmp_path, None, None, kv_pool=pool)
    assert pool.keys is not None, "a pool with a live sequence keeps its buffers"
    tiered.close()
    held.close()
    assert pool.keys is not None and pool.meter.total == pool.bytes_for(*PLANNED)  # planned: kept when empty
    tiered = build_cache("tiered-host", model, CacheConfig(block_tokens=8), tmp_path, None, None, kv_pool=pool)
    assert pool.keys is None and pool.meter.total == 0
    tiered.close()
    PooledCache(pool, 64).close()
    assert pool.generation == 2  # the next pooled sequence made it again


def test_a_pool_made_again_at_the_same_address_with_another_shape_is_a_new_generation(caplog) -> None:
    """The old static step keyed its graphs by the keys' address: a pool freed and made again at the
    same address with another shape (what the allocator does for a same-sized block) would have
    replayed graphs over strides that are no longer there. Here what the step recorded for the first
    buffers (a failed capture: no CUDA on this machine) is dropped for the second, and tried again."""
    model = tiny_model("llama-gqa")
    # big enough that the allocator maps the block and maps it again at the same place when freed
    pool = _pool(model, (16, 16384))
    pool.reserve()
    first = (pool.keys.data_ptr(), pool.keys.shape, pool.generation)
    static = StaticStep(model, pool, graphs=True)
    cache = PooledCache(pool, 64)
    with caplog.at_level(logging.WARNING, "runner.engine.static_step"):
        static.run([3], [cache])
        assert static.failed_captures == 1
        static.run([4], [cache])
        assert static.failed_captures == 1, "a failed (bucket, span) is tried once per generation"
        cache.close()
        pool.give_way()
        pool.planned = (32, 8192)  # the same bytes, another shape
        pool.reserve()
        second = (pool.keys.data_ptr(), pool.keys.shape, pool.generation)
        assert second[0] == first[0] and second[1] != first[1], "the premise: the same address, another shape"
        assert second[2] == first[2] + 1
        cache = PooledCache(pool, 64)
        static.run([3], [cache])
        cache.close()
    assert static.failed_captures == 2, "what the step recorded for the old buffers was used for the new ones"
    assert len(caplog.records) == 1  # the reason logged once


@pytest.mark.parametrize("injected", [False, True])
def test_a_failed_capture_runs_its_steps_eagerly_with_the_same_tokens_and_says_so_once(
        injected: bool, tokenizer, tmp_path: Path, caplog) -> None:
    model = tiny_model("llama-gqa")
    eager, _ = _waves(model, tokenizer, _pool(model, PLANNED), tmp_path / "eager")
    pool = _pool(model, PLANNED)
    pool.reserve()
    engine, static = _engine(model, tokenizer, pool, graphs=True)
    reason = f"a capture failure injected by {FAULTS_ENV}"
    static.fail_captures = reason if injected else None  # else a real failure: this machine has no CUDA
    with caplog.at_level(logging.WARNING, "runner.engine.static_step"):
        static.capture_all(PLANNED[0])  # the worker's start: every bucket (1, 2, 4) and span, each failing
        assert static.captures == 0 and static.failed_captures == 3 * 1  # one span: the pool's 192 tokens
        got, _ = _waves(model, tokenizer, pool, tmp_path / "graphed", engine)
    assert got == eager and static.steps > 0 and static.replays == 0
    assert static.failed_captures == 3, "a (bucket, span) whose capture failed was tried again"
    failures = [r.getMessage() for r in caplog.records]
    assert len(failures) == 1, failures
    assert (reason if injected else "CUDA") in failures[0], failures


@pytest.mark.parametrize("asks_the_pool", [True, False])
def test_admission_asks_the_pool_so_sequences_past_its_slots_wait_without_a_memory_error(
        asks_the_pool: bool, tokenizer, tmp_path: Path) -> None:
    """A pool planned for four sequences whose budget holds two: the byte sums admission also reads let
    four in, but a third claim would need new buffers past the budget (three slots of 192 tokens). Asked, the pool says no and the third waits for a slot; not asked (the code before),
    the claim raises mid-batch and the batch is split. The same tokens either way."""
    model = tiny_model("llama-gqa")
    pool = _pool(model, PLANNED)
    pool.meter.budget_bytes = pool.bytes_for(2, PLANNED[1])
    pool.reserve()
    assert (pool.slots, pool.tokens) == (2, PLANNED[1])
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN, loop_stop={"enabled": False}),
                         "auto", PLANNED[0], BIG, _is_memory_error)
    prompts = [random_prompt(n)[0].tolist() for n in (125, 120, 130, 118)]  # each over 128 tokens with its summary

    def request(prompt: list[int], new: int) -> PassRequest:
        tokens = len(prompt) + new
        return PassRequest(prompt, new, device_bytes=1,
                           make_cache=lambda: build_cache("dynamic", model, CacheConfig(), None, None,
                                                          expected_tokens=tokens, kv_pool=pool),
                           fits=(lambda: pool.fits(tokens)) if asks_the_pool else None)

    try:
        futures = [engine.submit(request(prompt, new)) for prompt, new in zip(prompts, NEW)]
        got = [f.result(timeout=300).generation.tokens for f in futures]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n, LoopStopConfig(enabled=False)) for p, n in zip(prompts, NEW)]
    assert pool.generation == 1 and pool.most_rows == 2
    assert engine.plan.splits == 0
    # not asked, the claim's memory error lowered the batch limit and counts against growing it back
    assert (engine.plan.limit.memory_errors == 0) == asks_the_pool, engine.plan.limit.memory_errors


def test_a_meter_says_what_a_hold_would_do_without_holding() -> None:
    """`room_for` (what the pool's admission asks) agrees with `hold`, through a meter's pool too."""
    batch = ResidentMeter(100, "the batch's device", "cache.device_kv_budget_bytes")
    cache = ResidentMeter(80, "a cache's device", "cache.device_kv_budget_bytes", batch)
    batch.hold("pool", 30)
    cache.hold("layer", 50)
    assert cache.room_for("layer", 70) and not cache.room_for("layer", 71)  # the batch: 30 + 70
    assert not cache.room_for("other", 31)  # the cache's own 80
    assert (batch.total, cache.total) == (80, 50)  # nothing held by asking
    with pytest.raises(KVBudgetExceeded):
        cache.hold("layer", 71)
