"""One try of a pass on one cache rung (runner/engine/rung_attempt.py), and the cache recipes it hands
the engine (runner/engine/cache_recipe.py): a real worker on the tiny model, its real engine.

The ladder around the attempt (fallbacks, freed caches, failure classes) is tested through the
worker in tests/test_worker_memory.py, tests/test_ladder_e2e.py and tests/test_setting_failures.py.
"""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path

import pytest

from jobs.config import load_config
from jobs.kvplan import device_kv_bytes, host_kv_bytes
from runner.engine.batch_engine import TaskClock
from runner.engine.kvcache import BudgetedDynamicCache, TieredCache
from runner.engine.probes import StageMemory
from runner.engine.rung_attempt import RungAttempt
from runner.engine.worker import SummaryWorker
from tests.helpers.cli import TINY_CONFIG

NEW_TOKENS = 4


def _worker(tmp_path: Path, *overrides: str) -> SummaryWorker:
    config = load_config(TINY_CONFIG, ["batch.attention=per-row", *overrides])
    return SummaryWorker(config, "job", str(tmp_path / "kv"), threads=1)


def _prompts(worker: SummaryWorker, lengths: list[int]) -> list[list[int]]:
    words = worker.loaded.tokenizer("the licence grants every user the right to copy " * 40)["input_ids"]
    return [words[:n] for n in lengths]


def test_an_attempt_runs_its_pass_in_its_own_folder_and_keeps_its_cache_figures(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    attempt = RungAttempt("tiered-disk", worker.cache_kit, worker.engine, StageMemory(), TaskClock(), scratch,
                          "doc-1", fault=None)
    try:
        generation = attempt.run(_prompts(worker, [150])[0], NEW_TOKENS)
    finally:
        worker.engine.close()
    assert len(generation.tokens) == NEW_TOKENS
    assert attempt.cache_stats["offload_bytes_written"] > 0  # the pass's figures, from its tiered-disk cache
    assert attempt.cache_stats["compression_ratio"] is not None
    assert list(scratch.iterdir()) == []  # the pass's own folder went with its cache
    # its decode row-steps, by path: per-row attention has no static step
    assert attempt.decode_steps == {"static": 0, "eager": {"static_step off": NEW_TOKENS - 1}, "ahead": 0}


def test_an_injected_fault_strikes_once_the_pass_has_ended(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    attempt = RungAttempt("tiered-disk", worker.cache_kit, worker.engine, StageMemory(), TaskClock(), scratch,
                          "doc-1", fault="io")
    try:
        with pytest.raises(OSError) as raised:
            attempt.run(_prompts(worker, [150])[0], NEW_TOKENS)
    finally:
        worker.engine.close()
    assert raised.value.errno == errno.EIO
    assert str(raised.value).endswith("(injected for doc-1 on tiered-disk)")
    # the moment it struck: the pass had ended (its cache and folder gone) and been counted
    assert attempt.cache_stats["offload_bytes_written"] > 0
    assert scratch.is_dir() and list(scratch.iterdir()) == []


def test_each_rungs_recipe_builds_its_own_kind_of_cache_and_the_handle_says_which(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    worker.engine.close()
    kit = worker.cache_kit

    dynamic = kit.recipe("dynamic", 120, None)
    with dynamic() as one, dynamic() as two:  # a pass started over after a split gets a fresh cache
        assert isinstance(one.cache, BudgetedDynamicCache) and one.cache is not two.cache
        assert one.generate_kwargs == {"past_key_values": one.cache}
    assert dynamic.device_bytes == device_kv_bytes(kit.shape, "dynamic", 120, None)

    tiered = kit.recipe("tiered-host", 120, None)
    with tiered() as handle:
        assert isinstance(handle.cache, TieredCache)
    assert tiered.host_bytes == host_kv_bytes(kit.shape, "tiered-host", 120, None, kit.settings.block_tokens)

    with kit.recipe("static", 120, None)() as handle:  # transformers' own: generate() builds it
        assert handle.cache is None
        assert handle.generate_kwargs == {"cache_implementation": "static"}

    with pytest.raises(dataclasses.FrozenInstanceError):
        dynamic.tokens = 1  # type: ignore[misc]


def test_a_tiered_recipe_keeps_the_layers_its_plan_leaves_on_the_device(tmp_path: Path) -> None:
    """A device budget for three of the tiny model's four layers: besides the two a streamed pass
    computes in, one stays resident; the cache the recipe builds is made with that very placement."""
    probe = _worker(tmp_path / "probe")
    probe.engine.close()
    whole = device_kv_bytes(probe.cache_kit.shape, "dynamic", 400, None)
    worker = _worker(tmp_path, f"cache.device_kv_budget_bytes={whole * 3 // 4}")
    worker.engine.close()
    recipe = worker.cache_kit.recipe("tiered-host", 400, None)
    assert recipe.placement is not None and len(recipe.placement.resident_layers) == 1
    assert recipe.device_bytes == recipe.placement.device_bytes
    with recipe() as handle:
        assert handle.cache.placement is recipe.placement
