"""Memory across cache fallbacks: the failed rung's cache is freed before the next rung allocates.

An exception kept past its `except` block keeps its traceback, whose frames hold the failed
rung's cache and activations; on a GPU the next rung then meets a real OOM. The worker runs here
for real (the tiny model, a real forced OOM on the first rung); the hook is the cache recipe's call
that builds each rung's cache, wrapped to look at what is still alive at that moment.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import runner.engine.cache_recipe as cache_recipe_module
from jobs.config import load_config
from jobs.faults import FaultRule
from jobs.task import Task
from runner.engine.worker import SummaryWorker
from tests.helpers.cli import LICENSES, TINY_CONFIG
from tests.helpers.summarize import summarize


def test_the_failed_rungs_cache_is_freed_before_the_next_rung_starts(tmp_path: Path, monkeypatch) -> None:
    config = load_config(TINY_CONFIG, ["cache.strategy=auto", "cache.ladder=[dynamic, tiered-disk]"])
    faults = [FaultRule(doc="doc-1", fault="oom", rungs=["dynamic"])]
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), faults, threads=1)
    built: list[tuple[str, weakref.ref]] = []
    alive_when_built: list[tuple[str, list[str]]] = []
    real_build_cache = cache_recipe_module.build_cache

    def build_and_watch(rung: str, *args, **kwargs):
        alive_when_built.append((rung, [r for r, cache in built if r != rung and cache() is not None]))
        handle = real_build_cache(rung, *args, **kwargs)
        built.append((rung, weakref.ref(handle.cache)))
        return handle

    monkeypatch.setattr(cache_recipe_module, "build_cache", build_and_watch)
    # map-reduced: the fault strikes after the chunks, which tiered-disk reuses; its merges build caches
    text = (LICENSES / "GPL-2").read_text()
    task = Task(task_id="t000001", doc_id="doc-1", source_type="text", source=text, n_chars=len(text),
                n_bytes=len(text.encode()), sha256=hashlib.sha256(text.encode()).hexdigest(), overrides={}, meta={})

    outcome = summarize(worker, task, config.summarize.context_tokens)

    assert outcome["status"] == "done" and outcome["cache_strategy"] == "tiered-disk", outcome
    assert outcome["fallbacks"] == ["cache:dynamic->tiered-disk (OutOfMemoryError)"]
    first_of_next = next(alive for rung, alive in alive_when_built if rung == "tiered-disk")
    assert first_of_next == [], "the dynamic rung's cache was still alive when tiered-disk started"


def test_a_ladder_that_runs_out_reports_the_last_error_by_type_and_message(tmp_path: Path) -> None:
    config = load_config(TINY_CONFIG, ["cache.strategy=auto", "cache.ladder=[dynamic, tiered-disk]"])
    faults = [FaultRule(doc="doc-1", fault="oom")]
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), faults, threads=1)
    text = "a short document. " * 50
    task = Task(task_id="t000001", doc_id="doc-1", source_type="text", source=text, n_chars=len(text),
                n_bytes=len(text.encode()), sha256=hashlib.sha256(text.encode()).hexdigest(), overrides={}, meta={})
    outcome = summarize(worker, task, config.summarize.context_tokens)
    assert outcome["status"] == "failed" and outcome["failure_class"] == "memory"
    assert outcome["error_type"] == "OutOfMemoryError"
    assert outcome["error"] == "CUDA out of memory (injected for doc-1 on tiered-disk)"
