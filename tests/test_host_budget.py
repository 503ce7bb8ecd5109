"""Host RAM for KV is one budget per worker, shared fairly by the workers of a node.

Each tiered cache counts its host RAM against the worker's host pool (as its device KV counts
against the device pool), batch admission adds up the host KV of the joined sequences, and an
`auto` budget is this worker's share of the node: the pool learns from the cluster's per-node
resources how many workers land on one node and tells each of them. Real caches and a real worker on
the tiny model (the pool's side, on a real local Ray: tests/test_pool.py).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from jobs.config import CacheConfig, SummarizeConfig, load_config
from jobs.kvplan import host_kv_bytes
from jobs.node_share import workers_per_device, workers_per_node
from jobs.task import Task
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.kvcache import KVBudgetExceeded, ResidentMeter, build_cache, kv_shape, resolve_budgets
from runner.engine.probes import StageMemory
from runner.engine.worker import SummaryWorker, _is_memory_error
from tests.helpers.batching import BIG, PLAIN, as_loaded_model, tokens_alone
from tests.helpers.cli import TINY_CONFIG
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.system import half_available_ram
from tests.helpers.summarize import summarize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 8


def _task(doc_id: str, text: str, **overrides: object) -> Task:
    return Task(
        task_id=f"t-{doc_id}", doc_id=doc_id, source_type="text", source=text, n_chars=len(text),
        n_bytes=len(text.encode()), sha256=hashlib.sha256(text.encode()).hexdigest(), overrides=overrides, meta={},
    )


# -- the pooled host meter ----------------------------------------------------------------------

def test_tiered_caches_of_one_worker_share_its_host_budget_and_give_it_back(tmp_path: Path) -> None:
    """Two host-tier caches that each fit the budget alone: the second to pass the pool's budget is
    refused with the error that moves a task on (naming the key), and closing gives every byte back."""
    model = tiny_model("llama-gqa")
    prompt = torch.tensor([random_prompt(3 * BLOCK)[0].tolist()])
    one = host_kv_bytes(kv_shape(model.config), "tiered-host", 3 * BLOCK, None, BLOCK)
    pool = ResidentMeter(int(1.5 * one), "the batch's host RAM", "cache.host_kv_budget_bytes")
    cfg = CacheConfig(block_tokens=BLOCK)
    first = build_cache("tiered-host", model, cfg, None, None, host_budget_bytes=one, host_meter=pool)
    second = build_cache("tiered-host", model, cfg, None, None, host_budget_bytes=one, host_meter=pool)
    with torch.no_grad():
        model(prompt, **first.generate_kwargs)
        assert pool.total == one  # the meter counts what host_kv_bytes (admission's figure) says
        with pytest.raises(KVBudgetExceeded, match=r"the batch's host RAM .*cache\.host_kv_budget_bytes"):
            model(prompt, **second.generate_kwargs)
    first.close()
    second.close()
    assert pool.total == 0


def test_admission_keeps_the_batchs_host_kv_within_the_host_budget(tokenizer, tmp_path: Path) -> None:
    """Four tiered-host sequences whose host KV fits two at a time: never more than two decode
    together, none is split or fails, and each gives the tokens it gives alone."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in (30, 20, 25, 28)]
    new = 10
    shape = kv_shape(model.config)
    host = [host_kv_bytes(shape, "tiered-host", len(p) + new, None, BLOCK) for p in prompts]
    pool = ResidentMeter(BIG, "the batch's host RAM", "cache.host_kv_budget_bytes")
    cfg = CacheConfig(block_tokens=BLOCK)
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN),
                               "auto", 4, BIG, _is_memory_error, host_budget=2 * max(host))
    try:
        futures = [engine.submit(PassRequest(
            p, new, device_bytes=0, host_bytes=h, memory=StageMemory(),
            make_cache=lambda: build_cache("tiered-host", model, cfg, None, None, host_meter=pool),
        )) for p, h in zip(prompts, host)]
        got = [f.result(timeout=120).generation.tokens for f in futures]
    finally:
        engine.close()
    assert engine.plan.most_rows == 2 and engine.plan.splits == 0
    assert 2 * min(host) <= pool.peak <= 2 * max(host)  # two did hold host KV together, never three
    assert got == [tokens_alone(model, p, new) for p in prompts]
    assert pool.total == 0


def test_a_workers_tasks_share_its_host_budget(tmp_path: Path) -> None:
    """Three tasks in flight on one worker (as its actor threads run them) whose host KV fits one at a
    time: they decode one after another instead of together past the budget, and all are done."""
    config = load_config(TINY_CONFIG, ["cache.strategy=tiered-host", "cache.host_kv_budget_bytes=200000"])
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), threads=1)
    text = "a short document. " * 20
    outcomes: dict[str, dict] = {}

    def run(doc_id: str) -> None:
        task = _task(doc_id, text, max_new_tokens=24)
        outcomes[doc_id] = summarize(worker, task, config.summarize.context_tokens)

    threads = [threading.Thread(target=run, args=(f"doc-{i}",)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        worker.engine.close()
    assert [o["status"] for o in outcomes.values()] == ["done"] * 3, outcomes
    for o in outcomes.values():  # each pass's host KV fits the budget alone, two of them do not
        one = host_kv_bytes(worker.kv_shape, "tiered-host", o["input_tokens"] + 24, None, 64)
        assert one <= 200_000 < 2 * one, (o["input_tokens"], one)
    assert [o["batch_size"] for o in outcomes.values()] == [1.0] * 3  # one at a time: admission held them
    assert worker.engine.plan.splits == 0  # ... before the pool's budget had to stop one
    assert 0 < worker.host_meter.peak <= 200_000 and worker.host_meter.total == 0


# -- auto budgets: this worker's share of the node ----------------------------------------------

@pytest.mark.parametrize(("count", "nodes", "cpus", "gpus", "expected"), [
    (2, [{"CPU": 2}], 1, 0, 2),  # one machine, two CPU workers
    (5, [{"CPU": 16}], 2, 0, 5),
    (16, [{"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 8}], 1, 1, 8),  # one worker a GPU, two 8-GPU nodes
    (4, [{"CPU": 8}, {"CPU": 8}, {"CPU": 8}], 1, 0, 2),  # spread: 2, 1, 1
    (4, [{"CPU": 8, "GPU": 1}], 1, 0.25, 4),  # four actors on one GPU
    (3, [{"CPU": 1}, {"CPU": 8}], 1, 0, 2),  # the small node is full after one
    (1, [{"CPU": 1}], 4, 0, 1),  # fits nowhere: shares with nobody
])
def test_workers_per_node_follows_the_spread_over_the_nodes_resources(
        count: int, nodes: list, cpus: float, gpus: float, expected: int) -> None:
    assert workers_per_node(count, nodes, cpus, gpus) == expected


@pytest.mark.parametrize(("node_workers", "gpus", "expected"), [(4, 0.25, 4), (8, 0.5, 2), (8, 1, 1), (3, 0, 3),
                                                                 (2, 0.1, 2)])
def test_workers_per_device(node_workers: int, gpus: float, expected: int) -> None:
    assert workers_per_device(node_workers, gpus) == expected


def test_auto_budgets_are_this_workers_share_of_the_node() -> None:
    before = half_available_ram()
    device, host = resolve_budgets(CacheConfig(), torch.device("cpu"), node_workers=4)
    after = half_available_ram()
    assert min(before, after) // 4 * 0.9 <= host <= max(before, after) // 4 * 1.1
    assert device == host  # on CPU the device is the same RAM
    explicit = CacheConfig(host_kv_budget_bytes=654_321, device_kv_budget_bytes=123_456)
    assert resolve_budgets(explicit, torch.device("cpu"), node_workers=4) == (123_456, 654_321)  # asked for: kept
