"""The worker's engine on real (tiny random) models: batched sequences give their tokens alone.

The reference for "alone" is plain transformers: `model.generate` with its own DynamicCache, greedy,
one prompt at a time. Every test also asserts that batching really happened (the largest decode
batch the engine ran), so none of them passes by running one sequence at a time.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path

import pytest
import torch

from jobs.config import CacheConfig, SummarizeConfig
from jobs.kvplan import kv_bytes
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.kvcache import ResidentMeter, build_cache, kv_shape
from runner.engine.probes import StageMemory
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, LENGTHS, NEW, PLAIN, as_loaded_model, run_batch, tokens_alone
from tests.helpers.models import ARCHS, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("strategy", ["dynamic", "tiered-host", "tiered-disk"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_tokens_equal_tokens_alone(arch: str, strategy: str, tokenizer, tmp_path: Path) -> None:
    model = tiny_model(arch)
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS]
    expected = [tokens_alone(model, p, n) for p, n in zip(prompts, NEW)]
    settings = SummarizeConfig(**PLAIN, prefill_chunk_size=16)  # chunked prefill (layer-major on tiered rungs)
    engine = BatchEngine(as_loaded_model(model, tokenizer), settings, "auto", 4, BIG, _is_memory_error)
    try:
        got = run_batch(engine, model, strategy, tmp_path, prompts, NEW)
    finally:
        engine.close()
    assert [g.tokens for g in got] == expected
    assert engine.plan.most_rows == 4  # at most 4 at once, and 4 did decode together
    assert max(g.batch_size for g in got) > 2


def test_sampling_with_a_seed_does_not_depend_on_the_batch(tokenizer, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS]
    settings = SummarizeConfig(**PLAIN, do_sample=True, seed=7, prefill_chunk_size=0)
    runs = {}
    for width in (1, 4):
        engine = BatchEngine(as_loaded_model(model, tokenizer), settings, "auto", width, BIG, _is_memory_error)
        try:
            runs[width] = [g.tokens for g in run_batch(engine, model, "dynamic", tmp_path, prompts, NEW)]
        finally:
            engine.close()
        assert engine.plan.most_rows == width
    assert runs[1] == runs[4]
    assert runs[1] != [tokens_alone(model, p, n) for p, n in zip(prompts, NEW)]  # it did sample


def test_generation_settings_choose_the_tokens_as_generate_does(tokenizer, tmp_path: Path) -> None:
    """`summarize.generation` fields (logits processors) act on each sequence over its own tokens."""
    model = tiny_model("llama-gqa")
    extra = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS]
    settings = SummarizeConfig(generation=extra)
    engine = BatchEngine(as_loaded_model(model, tokenizer), settings, "auto", 4, BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, model, "dynamic", tmp_path, prompts, NEW)]
    finally:
        engine.close()
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, **extra)[0, len(p):].tolist()
                    for p, n in zip(prompts, NEW)]
    assert got == expected and engine.plan.most_rows == 4
    assert expected != [tokens_alone(model, p, n) for p, n in zip(prompts, NEW)]  # the settings changed the tokens


def test_a_batch_that_runs_out_of_memory_splits_and_every_sequence_finishes(tokenizer, tmp_path: Path) -> None:
    """The worker's device pool holds about two sequences; admission lets four in (its budget is
    larger), so a decode step passes the pool's budget: the batch splits, nobody fails."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:4]]
    new = [24] * 4
    full = kv_bytes(kv_shape(model.config), max(LENGTHS[:4]) + 24)
    pool = ResidentMeter(int(2.5 * full), "the batch's resident device", "cache.device_kv_budget_bytes")
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 4, BIG, _is_memory_error)
    try:
        got = run_batch(engine, model, "dynamic", tmp_path, prompts, new, pool=pool)
    finally:
        engine.close()
    assert engine.plan.splits >= 1 and engine.plan.limit.current <= 2
    assert [g.tokens for g in got] == [tokens_alone(model, p, n) for p, n in zip(prompts, new)]
    assert pool.total == 0  # every cache gave its room back


def test_admission_keeps_the_batch_within_the_device_budget(tokenizer, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:4]]
    one = max(kv_bytes(kv_shape(model.config), len(p) + n) for p, n in zip(prompts, NEW))
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 4, 2 * one,
                               _is_memory_error)
    try:
        got = run_batch(engine, model, "dynamic", tmp_path, prompts, NEW[:4])
    finally:
        engine.close()
    assert engine.plan.most_rows == 2 and engine.plan.splits == 0
    assert [g.tokens for g in got] == [tokens_alone(model, p, n) for p, n in zip(prompts, NEW[:4])]


def test_a_sequence_whose_cache_fails_fails_alone(tokenizer, tmp_path: Path) -> None:
    """A tiered-disk sequence's block files are cut short mid-decode (a real damaged-block error when
    it reads them back): it fails with that error, and its batch-mates finish with their tokens alone."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:3]]
    new = [40, 200, 40]  # the damaged one decodes long after its batch-mates join: its files are still there
    cfg = CacheConfig(block_tokens=8)
    broken: dict[str, object] = {}

    def make_cache(i: int):
        strategy = "tiered-disk" if i == 1 else "dynamic"
        handle = build_cache(strategy, model, cfg, tmp_path / f"seq-{i}", None, None)
        if i == 1:
            broken["cache"] = handle.generate_kwargs["past_key_values"]
        return handle

    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 3, BIG, _is_memory_error)
    try:
        requests = [PassRequest(p, n, make_cache=lambda i=i: make_cache(i), device_bytes=0)
                    for i, (p, n) in enumerate(zip(prompts, new))]
        futures = [engine.submit(r) for r in requests]
        while engine.plan.most_rows < 3:  # all three decode together: now take the disk away
            time.sleep(0.001)
        for block in (tmp_path / "seq-1").rglob("*"):
            if block.is_file():
                block.write_bytes(b"")
        results = []
        for f in futures:
            try:
                results.append(f.result(timeout=300).generation.tokens)
            except Exception as e:  # noqa: BLE001 - the one expected failure
                results.append(e)
    finally:
        engine.close()
    assert isinstance(results[1], Exception) and not _is_memory_error(results[1]), results[1]
    # handed over without the failed step's frames (they would keep its cache alive): its traceback
    # starts where the task re-raised it
    frames = {frame.name for frame in traceback.extract_tb(results[1].__traceback__)}
    assert frames.isdisjoint({"_step", "update", "ragged_attention"}), frames
    assert results[0] == tokens_alone(model, prompts[0], 40) and results[2] == tokens_alone(model, prompts[2], 40)


def test_stage_memory_is_recorded_per_sequence(tokenizer, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 2, BIG, _is_memory_error)
    memory = StageMemory()
    try:
        request = PassRequest(random_prompt(30)[0].tolist(), 8,
                              make_cache=lambda: build_cache("dynamic", model, CacheConfig(), None, None),
                              device_bytes=0, memory=memory)
        engine.submit(request).result(timeout=60)
        one_token = dataclasses.replace(request, max_new_tokens=1, memory=StageMemory())
        engine.submit(one_token).result(timeout=60)
    finally:
        engine.close()
    assert memory.prefill_host_rss_bytes > 0 and memory.decode_peak_host_rss_bytes > 0
    assert 0 < memory.host_used_fraction < 1 and memory.device_peak_bytes is None  # CPU: no device figures
    assert one_token.memory.prefill_host_rss_bytes > 0 and one_token.memory.decode_peak_host_rss_bytes is None
