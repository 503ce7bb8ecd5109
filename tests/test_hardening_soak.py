"""Soak: one long-lived worker runs 100 tasks; memory, open files and threads must not creep up."""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
from pathlib import Path

import psutil

from jobs.config import load_config
from jobs.manifest import read_manifest
from runner.engine.worker import SummaryWorker
from storage.scratch import ROOT_MARKER
from tests.child_process import Child
from tests.conftest import LICENSES, TINY_CONFIG, write_jsonl

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


def soak(tmp_path: Path) -> dict:
    """100 tasks in one worker of this process: what each left behind, and where they ran."""
    config = load_config(TINY_CONFIG, ["cache.ladder=[dynamic, tiered-disk]", f"cache.device_kv_budget_bytes={DEVICE_KV_BUDGET}"])
    tasks, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", _varied_documents(N_TASKS)), config.input)
    assert not rejections and len(tasks) == N_TASKS
    worker = SummaryWorker(config.model_dump(mode="json"), "soak", str(tmp_path / "offload"), threads=1)
    context = config.summarize.context_tokens
    snapshots, strategies = [], set()
    # longest first, as the coordinator dispatches: the first task sets the working set a worker keeps
    for task in sorted(tasks, key=lambda t: t.n_chars, reverse=True):
        outcome = worker.run(dataclasses.asdict(task), attempt=1, context_tokens=context)
        assert outcome["status"] == "done", outcome
        strategies.add(outcome["cache_strategy"])
        snapshots.append(_host_snapshot())
    leftovers = [str(p) for p in (tmp_path / "offload").rglob("*") if p.name != ROOT_MARKER]
    return {"snapshots": snapshots, "strategies": sorted(strategies), "leftovers": leftovers}


SOAK_PROCESS = """
import json, sys
from pathlib import Path
from tests.test_hardening_soak import soak
print(json.dumps(soak(Path(sys.argv[1]))), flush=True)
"""


def test_hundred_tasks_in_one_worker_release_memory_files_and_threads(tmp_path: Path) -> None:
    # a process of its own, as a worker has: the allocator state other tests left must not count
    found = json.loads(Child(SOAK_PROCESS, str(tmp_path)).read_line(timeout_s=900))
    snapshots = found["snapshots"]
    assert found["strategies"] == ["dynamic", "tiered-disk"]  # both the device and the offload path soaked
    first_rss, first_fds, first_threads = snapshots[0]
    worst = max(rss for rss, _, _ in snapshots)
    assert worst <= first_rss * (1 + RSS_TOLERANCE), (
        f"host RSS grew from {first_rss} after the first task to {worst} "
        f"(+{(worst - first_rss) / first_rss:.1%}, allowed {RSS_TOLERANCE:.0%})"
    )
    assert max(fds for _, fds, _ in snapshots) <= first_fds, [fds for _, fds, _ in snapshots]
    assert max(threads for _, _, threads in snapshots) <= first_threads, [t for _, _, t in snapshots]
    assert not found["leftovers"]  # every task's scratch dir was removed
