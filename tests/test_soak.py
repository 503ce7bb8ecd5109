"""Soak: one long-lived worker runs 100 tasks; memory, open files and threads must not creep up."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import psutil
import pytest

from jobs.config import load_config
from jobs.faults import FaultRule
from jobs.manifest import read_manifest
from runner.engine.worker import SummaryWorker
from storage.scratch import ROOT_MARKER
from tests.helpers.child_process import Child
from tests.helpers.cli import LICENSES, TINY_CONFIG, write_jsonl
from tests.helpers.summarize import summarize

N_TASKS = 100
RSS_TOLERANCE = 0.02
#: KV bytes of ~600 tokens of the tiny model: shorter documents stay on the device, longer go to disk
DEVICE_KV_BUDGET = 614_400


def _varied_documents(n: int) -> list[dict]:
    """Real license texts cut to lengths from a few hundred characters to several chunks."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(LICENSES.iterdir()) if p.is_file()]
    docs = []
    for i in range(n):
        text = texts[i % len(texts)]
        length = 300 + (i * 997) % 6000
        docs.append({"id": f"doc-{i}", "text": (text * (1 + length // len(text)))[:length]})
    return docs


def _host_snapshot() -> tuple[int, int, int]:
    gc.collect()
    process = psutil.Process()
    return process.memory_info().rss, process.num_fds(), threading.active_count()


def _alternate_faults(tasks: list) -> list[FaultRule]:
    """Every other task fails on purpose, alternately out of memory on every rung and with an I/O error."""
    return [FaultRule(doc=t.doc_id, fault="oom" if i % 4 == 1 else "io") for i, t in enumerate(tasks) if i % 2]


def soak(tmp_path: Path, order: str = "longest-first") -> dict:
    """Tasks in one worker of this process: what each left behind, and where they ran.

    longest-first: 100 tasks as the coordinator dispatches them (the first sets the working set).
    shortest-first: 50 tasks from the shortest to the longest, run twice (100 runs), with faults on
    alternate tasks: the first pass grows the working set to the longest task's, so any growth over
    the second pass is what tasks leave behind, failed ones included.
    """
    config = load_config(TINY_CONFIG, ["cache.ladder=[dynamic, tiered-disk]", f"cache.device_kv_budget_bytes={DEVICE_KV_BUDGET}"])
    tasks, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", _varied_documents(N_TASKS)), config.input)
    assert not rejections and len(tasks) == N_TASKS
    if order == "longest-first":
        runs, faults = sorted(tasks, key=lambda t: t.n_chars, reverse=True), []
    else:
        ladder = sorted(tasks, key=lambda t: t.n_chars)[::2]
        runs, faults = ladder + ladder, _alternate_faults(ladder)
    worker = SummaryWorker(config, "soak", str(tmp_path / "offload"), faults=faults, threads=1)
    gc.collect()
    gc.freeze()  # what the imports and the load made stays: each snapshot's collection walks only what tasks made
    context = config.summarize.context_tokens
    snapshots, strategies, outcomes = [], set(), []
    for task in runs:
        outcome = summarize(worker, task, context)
        outcomes.append([task.doc_id, outcome["status"], outcome.get("error_type")])
        strategies.add(outcome.get("cache_strategy"))
        snapshots.append(_host_snapshot())
    leftovers = [str(p) for p in (tmp_path / "offload").rglob("*") if p.name != ROOT_MARKER]
    return {"snapshots": snapshots, "strategies": sorted(s for s in strategies if s), "leftovers": leftovers,
            "outcomes": outcomes, "faults": {f.doc: f.fault for f in faults}}


SOAK_PROCESS = """
import json, sys
from pathlib import Path
from tests.test_soak import soak
print(json.dumps(soak(Path(sys.argv[1]), sys.argv[2])), flush=True)
"""


def _no_growth(snapshots: list, reference_rss: int) -> None:
    first_rss, first_fds, first_threads = snapshots[0]
    worst = max(rss for rss, _, _ in snapshots)
    assert worst <= reference_rss * (1 + RSS_TOLERANCE), (
        f"host RSS grew from {reference_rss} to {worst} "
        f"(+{(worst - reference_rss) / reference_rss:.1%}, allowed {RSS_TOLERANCE:.0%})"
    )
    assert max(fds for _, fds, _ in snapshots) <= first_fds, [fds for _, fds, _ in snapshots]
    assert max(threads for _, _, threads in snapshots) <= first_threads, [t for _, _, t in snapshots]


@pytest.fixture(scope="module")
def soaked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Both soaks at once, each in a process of its own, as a worker has (the allocator state other tests
    left must not count): they share the cores, never a heap, a file table or threads."""
    children = {order: Child(SOAK_PROCESS, str(tmp_path_factory.mktemp(order)), order)
                for order in ("longest-first", "shortest-first")}
    try:
        return {order: json.loads(child.read_line(timeout_s=900)) for order, child in children.items()}
    finally:
        for child in children.values():
            child.kill()


def test_hundred_tasks_in_one_worker_release_memory_files_and_threads(soaked: dict[str, dict]) -> None:
    found = soaked["longest-first"]
    snapshots = found["snapshots"]
    assert len(snapshots) == N_TASKS
    assert found["strategies"] == ["dynamic", "tiered-disk"]  # both the device and the offload path soaked
    assert {status for _, status, _ in found["outcomes"]} == {"done"}
    _no_growth(snapshots, reference_rss=snapshots[0][0])
    assert not found["leftovers"]  # every task's scratch dir was removed


def test_shortest_first_with_failures_on_alternate_tasks_leaves_nothing_behind(soaked: dict[str, dict]) -> None:
    found = soaked["shortest-first"]
    snapshots, outcomes, faults = found["snapshots"], found["outcomes"], found["faults"]
    assert len(snapshots) == N_TASKS
    assert found["strategies"] == ["dynamic", "tiered-disk"]
    expected = {None: ("done", None), "oom": ("failed", "OutOfMemoryError"), "io": ("failed", "OSError")}
    assert [tuple(o[1:]) for o in outcomes] == [expected[faults.get(doc)] for doc, _, _ in outcomes]
    assert {"oom", "io"} == set(faults.values())
    first_pass = snapshots[: len(snapshots) // 2]
    _no_growth(snapshots, reference_rss=max(rss for rss, _, _ in first_pass))
    assert not found["leftovers"]  # failed tasks' scratch dirs were removed too
