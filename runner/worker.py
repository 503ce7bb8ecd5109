"""The worker: holds one model and summarises one task at a time (a Ray actor in a batch).

It owns the cache ladder: a task starts on the first rung the planner says fits, and a device OOM
(real, from the budget guard, or a full offload disk) moves it to the next rung at once. What is
left (transient errors, shorter contexts) is the coordinator's business, so the worker reports a
failure's class instead of retrying it.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from jobs.config import JobConfig
from jobs.chunking import ContextTooSmallError
from jobs.documents import DocumentError, load_task_text
from jobs.faults import FaultRule, fault_for
from jobs.kvplan import TIER_OF, Placement, kv_bytes, plan_placement, plan_rungs
from jobs.manifest import Task
from jobs.policy import FailureClass, cache_fallback_note
from runner.generation import Generation, generate_once
from runner.kvcache import build_cache, kv_shape, resolve_budgets
from runner.models import load_model
from runner.probes import StageProbe, memory_snapshot
from runner.summarize import Summarizer
from storage.scratch import ScratchSpaceError, check_free_space, ensure_offload_root, sweep_orphans, task_scratch

DISK_RUNGS = frozenset({"tiered-disk"})

#: Rough characters per token, to size a task's KV cache before it is tokenised.
_CHARS_PER_TOKEN = 3


class _PeakRss:
    """Samples this process's RSS in the background: a task's peak, not the process's lifetime peak."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self._proc = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


@dataclass
class _CacheTotals:
    """Cache figures over all generate passes of one task."""

    kv_bytes: int = 0
    kv_resident_peak_bytes: int = 0
    offload_bytes_written: int = 0
    offload_bytes_read: int = 0
    _raw: int = 0
    _stored: int = 0
    passes: int = 0
    placement: Placement | None = None  # the pass that streamed the most layers

    def add_placement(self, placement: Placement | None) -> None:
        if placement is not None and (
            self.placement is None or len(placement.streamed_layers) > len(self.placement.streamed_layers)
        ):
            self.placement = placement

    def add(self, stats: dict[str, Any]) -> None:
        self.kv_bytes = max(self.kv_bytes, stats.get("kv_bytes") or 0)
        self.kv_resident_peak_bytes = max(
            self.kv_resident_peak_bytes, stats.get("kv_resident_peak_bytes") or 0
        )
        self.offload_bytes_written += stats.get("offload_bytes_written") or 0
        self.offload_bytes_read += stats.get("offload_bytes_read") or 0
        ratio = stats.get("compression_ratio")
        written = stats.get("offload_bytes_written") or 0
        if ratio and written:
            self._stored += written
            self._raw += int(written * ratio)

    @property
    def compression_ratio(self) -> float | None:
        return self._raw / self._stored if self._stored else None


def _is_memory_error(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, ScratchSpaceError)) or (
        isinstance(e, OSError) and e.errno == errno.ENOSPC
    )


def _fire(fault: str | None, task: Task, rung: str) -> None:
    """Injected faults raise what the real failure raises, where it would raise it."""
    if fault is None:
        return
    where = f"injected for {task.doc_id} on {rung}"
    if fault == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory ({where})")
    if fault == "crash":
        os._exit(17)
    if fault == "io":
        raise OSError(errno.EIO, f"Input/output error ({where})")
    if fault == "hang":
        while True:
            time.sleep(1)
    raise RuntimeError(f"injected error ({where})")


class SummaryWorker:
    def __init__(
        self,
        config: dict[str, Any],
        job_id: str,
        offload_root: str,
        faults: list[dict[str, Any]] | None = None,
        threads: int | None = None,
    ) -> None:
        self.cfg = JobConfig.model_validate(config)
        self.job_id = job_id
        self.offload_root = Path(offload_root)
        self.faults = [FaultRule.model_validate(f) for f in faults or []]
        if threads:
            torch.set_num_threads(max(1, int(threads)))
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        ensure_offload_root(self.offload_root)
        self.swept = sweep_orphans(self.offload_root)
        self.loaded = load_model(self.cfg.model)
        self.after_load = memory_snapshot(self.loaded.device)
        self.summarizer = Summarizer(self.loaded, self.cfg.summarize.chunk_overlap_tokens)
        self.kv_shape = kv_shape(self.loaded.model.config, self.loaded.dtype)
        self.device_budget, self.host_budget = resolve_budgets(self.cfg.cache, self.loaded.device)

    def info(self) -> dict[str, Any]:
        return {
            "worker": self.name,
            "device": str(self.loaded.device),
            "model": self.loaded.name,
            "load_s": self.loaded.load_s,
            "swept_dirs": len(self.swept),
        }

    def _rungs(self, task: Task, context_tokens: int, max_new_tokens: int) -> list[str]:
        if self.cfg.cache.strategy != "auto":
            return [self.cfg.cache.strategy]
        tokens = min(context_tokens, task.n_chars // _CHARS_PER_TOKEN + max_new_tokens + 64)
        return plan_rungs(
            self.cfg.cache.ladder,
            kv_bytes(self.kv_shape, tokens),
            self.device_budget,
            self.host_budget,
            self.loaded.device.type == "cpu",
        )

    def _placement(self, rung: str, tokens: int) -> Placement | None:
        """On a tiered rung, which layers of this pass stay on the device. None (every layer streamed)
        on other rungs, and when the whole KV would fit the device budget: then the tiered rung is
        there because the config asked for it (`cache.strategy`, or the ladder's order), not for lack
        of room, and it is honoured as asked."""
        if rung not in TIER_OF or kv_bytes(self.kv_shape, tokens) <= self.device_budget:
            return None
        return plan_placement(
            self.kv_shape, tokens, TIER_OF[rung], self.device_budget, self.host_budget,
            self.cfg.cache.block_tokens, device_is_cpu=self.loaded.device.type == "cpu",
        )

    def _summarize_on(
        self, rung: str, task: Task, attempt: int, text: str, context_tokens: int,
        max_new_tokens: int, instruction: str, totals: _CacheTotals,
    ) -> Any:
        with ExitStack() as stack:
            offload_dir: Path | None = None
            if rung in DISK_RUNGS:
                check_free_space(self.offload_root, kv_bytes(self.kv_shape, context_tokens))
                offload_dir = stack.enter_context(
                    task_scratch(self.offload_root, self.job_id, task.task_id, attempt)
                )

            def generate(prompt_ids: list[int], max_new: int) -> Generation:
                pass_dir = offload_dir / f"pass-{totals.passes}" if offload_dir else None
                tokens = len(prompt_ids) + max_new
                placement = self._placement(rung, tokens)
                handle = build_cache(
                    rung, self.loaded.model, self.cfg.cache, pass_dir, self.device_budget, self.host_budget,
                    placement, expected_tokens=tokens,
                )
                try:
                    gen = generate_once(
                        self.loaded, prompt_ids, max_new, self.cfg.summarize, handle.generate_kwargs,
                        self.cfg.cache.prefill,
                    )
                    # an injected failure strikes mid-task, with this pass's KV blocks in the scratch dir
                    _fire(fault_for(self.faults, task.doc_id, attempt, rung, context_tokens), task, rung)
                    totals.add(handle.stats())
                    totals.add_placement(placement)
                finally:
                    handle.close()
                totals.passes += 1
                return gen

            return self.summarizer.summarize(text, instruction, max_new_tokens, context_tokens, generate)

    def run(self, task_data: dict[str, Any], attempt: int, context_tokens: int) -> dict[str, Any]:
        """Summarise one task; returns an outcome dict (never raises for an expected failure)."""
        task = Task(**task_data)
        started = time.perf_counter()
        outcome: dict[str, Any] = {"worker": self.name, "model": self.loaded.name, "fallbacks": []}
        try:
            text = load_task_text(task)
        except DocumentError as e:
            return outcome | self._failure(FailureClass.INPUT, e, started)
        max_new = int(task.overrides.get("max_new_tokens", self.cfg.summarize.max_new_tokens))
        instruction = str(task.overrides.get("prompt", self.cfg.summarize.prompt))
        rungs = self._rungs(task, context_tokens, max_new)
        # (type name, message) only: the exception's traceback holds the failed rung's cache alive
        last_error: tuple[str, str] | None = None
        with _PeakRss() as rss, StageProbe(self.loaded.model, self.loaded.device) as probe:
            for i, rung in enumerate(rungs):
                totals = _CacheTotals()
                if last_error is not None:
                    self._release_memory()  # outside the except block: its frames are gone by now
                try:
                    summary = self._summarize_on(
                        rung, task, attempt, text, context_tokens, max_new, instruction, totals
                    )
                except ContextTooSmallError as e:
                    return outcome | self._failure(FailureClass.INPUT, e, started)
                except Exception as e:  # noqa: BLE001 - classified below, reported to the coordinator
                    if not _is_memory_error(e):
                        return outcome | self._failure(FailureClass.TRANSIENT, e, started)
                    last_error = (type(e).__name__, str(e))
                    next_rung = rungs[i + 1] if i + 1 < len(rungs) else None
                    outcome["fallbacks"].append(cache_fallback_note(rung, next_rung, type(e).__name__))
                    continue
                outcome.update(
                    status="done",
                    summary=summary.text,
                    input_tokens=summary.input_tokens,
                    output_tokens=summary.output_tokens,
                    chunks=summary.chunks,
                    cache_strategy=rung,
                    ttft_s=summary.ttft_s,
                    decode_tokens_per_s=summary.decode_tokens_per_s,
                    prefill_s=sum(p.ttft_s for p in summary.passes),
                    decode_s=sum(p.decode_s for p in summary.passes),
                    kv_bytes=totals.kv_bytes,
                    kv_resident_peak_bytes=totals.kv_resident_peak_bytes,
                    offload_bytes_written=totals.offload_bytes_written,
                    offload_bytes_read=totals.offload_bytes_read,
                    compression_ratio=totals.compression_ratio,
                    kv_placement=totals.placement.describe() if totals.placement else None,
                )
                break
        outcome.update(
            probe.row_fields(),
            peak_host_rss_bytes=max(rss.peak, probe.decode_peak_host_rss_bytes or 0),
            peak_device_bytes=probe.device_peak_bytes,
            load_host_rss_bytes=self.after_load.host_rss_bytes,
            load_device_bytes=self.after_load.device_bytes,
            host_used_fraction=probe.host_used_fraction,  # for the coordinator's memory alert
            device_used_fraction=probe.device_used_fraction,
        )
        outcome["wall_s"] = time.perf_counter() - started
        if outcome.get("status") == "done":
            return outcome
        assert last_error is not None
        self._release_memory()  # the shorter context the coordinator tries next starts from a clean slate
        return outcome | self._failure(FailureClass.MEMORY, last_error, started)

    def _failure(self, cls: FailureClass, e: BaseException | tuple[str, str], started: float) -> dict[str, Any]:
        """A failed outcome from an exception, or from the (type name, message) kept of one."""
        error_type, error = e if isinstance(e, tuple) else (type(e).__name__, str(e))
        return {
            "status": "failed",
            "failure_class": cls.value,
            "error_type": error_type,
            "error": error,
            "wall_s": time.perf_counter() - started,
        }

    def _release_memory(self) -> None:
        gc.collect()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()
