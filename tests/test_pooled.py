"""The pooled decode step (runner/engine/kvcache/pool.py, pooled_attention.py) on real tiny random models.

Like tests/test_batching.py: the reference is plain `model.generate` one prompt at a time, and
every test asserts that the path it targets really ran (the pool's own count of the rows it
attended in one call, the engine's largest batch), so none passes by running rows one by one.
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from jobs.config import ConfigError, SummarizeConfig, load_config
from jobs.task import Task
from runner.engine.batch_engine import BatchEngine
from runner.engine.kvcache import KVBudgetExceeded, ResidentMeter
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.worker import SummaryWorker, _is_memory_error
from tests.helpers.batching import BIG, LENGTHS, NEW, PLAIN, as_loaded_model, cpu_kv_pool, run_batch, tokens_alone
from tests.helpers.cli import LICENSES, TINY_CONFIG
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.summarize import summarize

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("path", ["pooled", "per-row"])
def test_batched_tokens_equal_tokens_alone_on_both_paths(path: str, tokenizer, tmp_path: Path) -> None:
    """Mixed prompt lengths, rows leaving at different steps and others joining (4 at a time of 5)."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS]
    pool = cpu_kv_pool(model) if path == "pooled" else None
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN, prefill_chunk_size=16), "auto", 4,
                               BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic"] * 5, tmp_path, prompts, NEW, kv_pool=pool)]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n) for p, n in zip(prompts, NEW)]
    assert engine.plan.most_rows == 4
    if pool is not None:
        assert pool.most_rows == 4 and pool.steps >= max(NEW) - 1  # every step attended the pool in one call
        assert pool.owners == [] and pool.keys is None and pool.meter.total == 0  # every slot given back


def test_a_step_with_pooled_and_tiered_rows_gives_each_its_tokens_alone(tokenizer, tmp_path: Path) -> None:
    """The tiered rows attend as a second group (runner/engine/tiered_attention.py) beside the
    pooled group, in the same forward pass."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS]
    strategies = ["dynamic", "tiered-host", "dynamic", "tiered-disk", "dynamic"]
    pool = cpu_kv_pool(model)
    made: dict[int, object] = {}
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 5, BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, model, strategies, tmp_path, prompts, NEW, kv_pool=pool, made=made)]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n) for p, n in zip(prompts, NEW)]
    assert engine.plan.most_rows == 5 and pool.most_rows == 3 and pool.meter.total == 0
    tiered = [made[i] for i, strategy in enumerate(strategies) if strategy.startswith("tiered")]
    assert [(c.most_batched_rows, c.batched_layers > 0) for c in tiered] == [(2, True), (2, True)]



def _four_dynamic_rows_match_generate(model, tokenizer, tmp_path: Path, prompts: list[list[int]], new: list[int],
                                      pool: KVPool) -> BatchEngine:
    """Run the four prompts as one batch of `dynamic` rows over `pool`; each must give generate()'s
    tokens. The closed engine, for its figures."""
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 4, BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic"] * 4, tmp_path, prompts, new, kv_pool=pool)]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n) for p, n in zip(prompts, new)]
    return engine

def test_a_full_pool_makes_a_sequence_wait_for_room(tokenizer, tmp_path: Path) -> None:
    """The pool's budget holds two slots: a third sequence is not failed (as a cache it could not
    make would be) but waits until one leaves; the batch never holds more than the pool does."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:4]]
    new = [12, 12, 12, 12]
    pool = cpu_kv_pool(model)
    slot = pool.bytes_for(1, 64)  # every sequence here fits one 64-token granule
    pool.meter.budget_bytes = 2 * slot
    engine = _four_dynamic_rows_match_generate(model, tokenizer, tmp_path, prompts, new, pool)
    assert pool.most_rows == 2 and engine.plan.limit.current == 2 and engine.plan.splits == 0
    assert pool.meter.peak <= 2 * slot and pool.meter.total == 0


def test_a_released_cache_is_gone_when_dropped_not_at_the_next_collection() -> None:
    """Its layers point back at it weakly: with no cycle to wait for the collector, a failed rung's cache
    is freed the moment its sequence drops it, before the next rung allocates (test_worker_memory.py)."""
    pool = cpu_kv_pool(tiny_model("llama-gqa"))
    cache = PooledCache(pool, 64)
    key = torch.randn(1, pool.kv_heads, 5, pool.head_dim)
    for layer in cache.layers:
        layer.update(key, key)
    length = cache.get_seq_length()
    assert length == 5
    cache.close()
    gone = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()


def test_a_pool_that_cannot_grow_mid_step_splits_the_batch(tokenizer, tmp_path: Path) -> None:
    """Without the expected length, slots start at 64 tokens; four of them fit the budget, but the
    step that needs 128 tokens each does not: the batch splits (in pool units) and every sequence
    finishes with its tokens alone."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:4]]
    new = [30, 30, 30, 30]  # the 51-token prompt passes 64 tokens mid-decode
    pool = cpu_kv_pool(model)
    pool.meter.budget_bytes = pool.bytes_for(4, 64) + pool.bytes_for(1, 64)
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 4, BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic"] * 4, tmp_path, prompts, new, kv_pool=pool,
                                           expected=False)]
    finally:
        engine.close()
    assert engine.plan.splits >= 1 and engine.plan.limit.current <= 2 and pool.most_rows == 4
    assert got == [tokens_alone(model, p, n) for p, n in zip(prompts, new)]
    assert pool.meter.total == 0


@pytest.mark.parametrize("planned", [None, (8, 60)])
def test_a_planned_pool_is_allocated_once_for_its_batch(planned: tuple[int, int] | None, tokenizer,
                                                        tmp_path: Path) -> None:
    """Four sequences joining the batch: without a plan the pool grows as they claim slots (new
    buffers and a copy each time: a new generation) and is freed when they leave; with one it is
    allocated once, at the first claim, for the plan's sequences cut to the four the budget has room
    for, and kept. The same tokens either way."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:4]]
    new = [12, 12, 12, 12]  # every sequence fits one 64-token granule
    meter = ResidentMeter(None, "the batch's resident device", "cache.device_kv_budget_bytes")
    pool = KVPool.for_model(model.config, torch.float32, torch.device("cpu"), meter, planned)
    meter.budget_bytes = pool.bytes_for(4, 64)
    _four_dynamic_rows_match_generate(model, tokenizer, tmp_path, prompts, new, pool)
    assert pool.most_rows == 4  # the four rows stepped together
    if planned is None:
        assert pool.generation > 1 and pool.meter.total == 0
    else:
        assert pool.generation == 1 and (pool.slots, pool.tokens) == (4, 64)
        assert pool.meter.total == pool.bytes_for(4, 64)


@pytest.mark.parametrize("planned", [None, (4, 64)])
def test_a_sequence_too_long_for_the_pool_alone_is_a_memory_error(planned: tuple[int, int] | None, tokenizer,
                                                                   tmp_path: Path) -> None:
    """What moves its task down the cache ladder: the budget guard's error, from the pool, with a
    plan too (its slots cut to the budget's one, the sequence longer than the plan)."""
    model = tiny_model("llama-gqa")
    pool = cpu_kv_pool(model)
    pool.planned = planned
    pool.meter.budget_bytes = pool.bytes_for(1, 64)
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 4, BIG, _is_memory_error)
    try:
        with pytest.raises(KVBudgetExceeded, match=r"cache\.device_kv_budget_bytes"):
            run_batch(engine, model, ["dynamic"], tmp_path, [random_prompt(60)[0].tolist()], [20], kv_pool=pool)
    finally:
        engine.close()
    assert pool.steps == 0 and pool.meter.total == 0


def test_batch_attention_is_validated_and_the_pool_refuses_sliding_windows() -> None:
    """Which path each setting takes: tests/test_attention.py."""
    assert load_config(None, ["batch.attention=pooled"]).batch.attention == "pooled"
    assert load_config(None, []).batch.attention == "auto"
    with pytest.raises(ConfigError, match=r"batch\.attention"):
        load_config(None, ["batch.attention=paged"])
    with pytest.raises(ValueError, match="full-attention layers only"):
        cpu_kv_pool(tiny_model("mistral-sliding"))


def _task(i: int, name: str) -> Task:
    text = (LICENSES / name).read_text()[:3000]
    return Task(task_id=f"t{i:06d}", doc_id=f"doc-{i}", source_type="text", source=text, n_chars=len(text),
                n_bytes=len(text.encode()), sha256=hashlib.sha256(text.encode()).hexdigest(), overrides={}, meta={})


def _summaries(worker: SummaryWorker, tasks: list[Task]) -> list[dict]:
    """The tasks run at once (as the worker's Ray actor runs them, one thread each)."""
    with ThreadPoolExecutor(len(tasks)) as threads:
        return list(threads.map(lambda task: summarize(worker, task, 1024), tasks))


def test_a_worker_on_the_pooled_path_summarises_as_the_per_row_path_does(tmp_path: Path) -> None:
    tasks = [_task(i, name) for i, name in enumerate(["BSD", "GPL-2", "Apache-2.0", "MPL-2.0"])]
    outcomes = {}
    for path in ("pooled", "per-row"):
        config = load_config(TINY_CONFIG, [f"batch.attention={path}", "cache.strategy=dynamic"])
        worker = SummaryWorker(config, "job", str(tmp_path / path), threads=1)
        try:
            outcomes[path] = _summaries(worker, tasks)
        finally:
            worker.engine.close()
        assert worker.info()["attention"] == path
        if path == "pooled":
            assert worker.kv_pool is not None and worker.kv_pool.most_rows >= 2 and worker.device_meter.total == 0
        else:
            assert worker.kv_pool is None
    assert all(o["status"] == "done" for o in outcomes["pooled"]), outcomes["pooled"]
    assert [o["summary"] for o in outcomes["pooled"]] == [o["summary"] for o in outcomes["per-row"]]

