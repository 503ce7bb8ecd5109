"""The worker: holds one model, plans documents' passes and runs passes, several at once (a Ray actor).

Its three calls across Ray (`plan`, `plan_merge`, `run_pass`): docs/design.md, "Documents and passes
(the only calls across Ray)"; every pass runs in the worker's one `BatchEngine`. The worker owns the
cache ladder: a device OOM (real, from the budget guard, or a full offload disk) moves a pass to the
next rung at once; other failures are reported by class for the coordinator to retry. It never writes
the job folder: a finished pass is the call's result.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import psutil
import torch

from jobs.attention import attention_path, static_step_on
from jobs.chunking import ContextTooSmallError
from jobs.config import ConfigError, JobConfig
from jobs.documents import DocumentError, load_task_text
from jobs.faults import FAULTS_ENV, FaultRule, fault_for
from jobs.kvplan import kv_bytes, plan_rungs
from jobs.node_share import workers_per_device
from jobs.outcome import CallOutcome, static_share
from jobs.passes import LevelPlan, PassRow, PassSpec, pass_key, settings_fingerprint
from jobs.policy import FailureClass, cache_fallback_note
from jobs.rungs import RUNGS
from jobs.task import Task
from runner.engine.batch_engine import BatchEngine, TaskClock
from runner.engine.cache_recipe import CacheKit
from runner.engine.kvcache import ResidentMeter, kv_shape, ram_left_by_weights, resolve_budgets
from runner.engine.kvcache.pool import KVPool
from runner.engine.model_loader import load_model
from runner.engine.probes import StageMemory, memory_snapshot
from runner.engine.rung_attempt import RungAttempt
from runner.engine.sdpa import choose_sdpa
from runner.engine.static_step import StaticStep, bucket
from runner.engine.summarize import Summarizer
from storage.scratch import (
    ScratchSpaceError,
    ensure_offload_root,
    sweep_orphans,
    task_scratch,
)


class _PeakRss:
    """Samples this process's RSS in the background: a task's peak, not the process's lifetime peak."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


_ALLOCATION_FAILURES = (
    "CUDA error: out of memory",  # C10_CUDA_CHECK on cudaErrorMemoryAllocation: a pinned cudaHostAlloc
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace
    "DefaultCPUAllocator: can't allocate memory",  # host RAM (the device itself on CPU)
)
"""What torch's allocators say when they fail outside its device allocator, which alone raises
`torch.OutOfMemoryError`: without these, a failed pinned allocation would be retried as transient
and the task would never move to a rung that needs less memory."""


def _is_memory_error(e: BaseException) -> bool:
    if isinstance(e, RuntimeError) and any(marker in str(e) for marker in _ALLOCATION_FAILURES):
        return True
    return isinstance(e, (torch.OutOfMemoryError, ScratchSpaceError)) or (
        isinstance(e, OSError) and e.errno == errno.ENOSPC
    )


def _is_setting_error(e: BaseException) -> bool:
    """Raised on a value of the config (a cache strategy the device lacks, a generation field of the
    wrong type): the same settings fail the same way, so a retry only burns attempts. A memory error
    (an OSError, a torch error) is never one."""
    return isinstance(e, (ConfigError, TypeError, ValueError)) and not _is_memory_error(e)


class SummaryWorker:
    def __init__(
        self,
        config: JobConfig,
        job_id: str,
        offload_root: Path,
        faults: list[FaultRule] | None = None,
        threads: int | None = None,
        node_workers: int = 1,
    ) -> None:
        """`node_workers`: how many workers of the batch share this node (the pool's count from the
        cluster's resources, jobs.node_share), among whom `auto` budgets are split."""
        self.cfg = config
        self.job_id = job_id
        self.offload_root = Path(offload_root)
        self.faults = list(faults or [])
        if threads:
            torch.set_num_threads(max(1, int(threads)))
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        ensure_offload_root(self.offload_root)
        self.swept = sweep_orphans(self.offload_root)
        self.ram_before_load = psutil.virtual_memory().available
        self.loaded = load_model(self.cfg.model)
        self.after_load = memory_snapshot(self.loaded.device)
        self.ram_left = ram_left_by_weights(self.ram_before_load, self.loaded.weight_bytes,
                                            psutil.virtual_memory().available)
        self.summarizer = Summarizer(self.loaded, self.cfg.summarize.chunk_overlap_tokens)
        self.fingerprint = settings_fingerprint(self.cfg, self.loaded.device.type, str(self.loaded.dtype))
        self.kv_shape = kv_shape(self.loaded.model.config, self.loaded.dtype)
        self.node_workers = max(1, node_workers)
        self.device_budget, self.host_budget = resolve_budgets(
            self.cfg.cache, self.loaded.device, self.node_workers,
            workers_per_device(self.node_workers, self.cfg.workers.gpus_per_worker), self.ram_left,
        )
        # one meter of the device and one of host RAM for every cache of the sequences batched here
        self.device_meter = ResidentMeter(self.device_budget, "the batch's resident device", "cache.device_kv_budget_bytes")
        self.host_meter = ResidentMeter(self.host_budget, "the batch's host RAM", "cache.host_kv_budget_bytes")
        self.attention = attention_path(self.cfg.batch.attention, self.loaded.device.type,
                                        any(window is not None for window in self.kv_shape.layer_windows))
        self.kv_pool = (KVPool.for_model(self.loaded.model.config, self.loaded.dtype, self.loaded.device,
                                         self.device_meter, self._pool_plan()) if self.attention == "pooled" else None)
        self.cache_kit = CacheKit(self.loaded.model, self.cfg.cache, self.kv_shape, self.device_budget,
                                  self.host_budget, self.device_meter, self.host_meter, self.kv_pool,
                                  device_is_cpu=self.loaded.device.type == "cpu")
        self.engine = BatchEngine(self.loaded, self.cfg.summarize, self.cfg.cache.prefill,
                                        self.cfg.batch.sequences, self.device_budget, _is_memory_error,
                                        host_budget=self.host_budget,
                                        prefill_chunk_tokens=self.cfg.batch.prefill_chunk_tokens,
                                        static=self._static_step())
        self.sdpa = choose_sdpa(self.cfg.batch.sdpa_backend, self.loaded.device)  # before any capture
        self.graphs = self._capture_graphs()
        self._calls: dict[str, TaskClock] = {}  # call id -> the clock of the pass in flight under it

    def _pool_plan(self) -> tuple[int, int] | None:
        """On CUDA the KV pool is sized once, for the batch's most sequences (and a static step's padding
        rows) at the longest pass (the context), so a decode never stops to grow and copy it; on the CPU
        the device budget is RAM, and a pool that grows with the batch leaves it to the rest."""
        if self.loaded.device.type != "cuda":
            return None
        sequences = self.cfg.batch.sequences
        return (bucket(sequences) if self._static_on() else sequences), self.cfg.summarize.context_tokens

    def _static_on(self) -> bool:
        return static_step_on(self.cfg.batch.static_step, self.loaded.device.type, self.attention)

    def _static_step(self) -> StaticStep | None:
        """The pooled steps in static buffers, captured as CUDA graphs on CUDA (`batch.static_step`)."""
        if self.kv_pool is None or not self._static_on():
            return None
        pieces = self.loaded.word_pieces if self.cfg.summarize.no_repeat_summary_ngram else None  # the ban's
        step = StaticStep(self.loaded.model, self.kv_pool, graphs=self.loaded.device.type == "cuda", pieces=pieces)
        if any(rule.fault == "capture" for rule in self.faults):
            step.fail_captures = f"a capture failure injected by {FAULTS_ENV}"
        return step

    def _capture_graphs(self) -> dict[str, Any] | None:
        """The KV pool made for the worker's life and every decode step of its batch captured now, not
        mid-batch (CUDA); what worker_ready tells job.log: graphs captured, seconds, failures."""
        static = self.engine.static
        if static is None or not static.graphs:
            return None
        assert self.kv_pool is not None
        self.kv_pool.reserve()
        static.capture_all(self.cfg.batch.sequences)
        return {"captured": static.captures, "capture_s": round(static.capture_s, 3),
                "failed": static.failed_captures, "failure": static.capture_failure,
                "pool_slots": self.kv_pool.slots, "pool_tokens": self.kv_pool.tokens}

    def info(self) -> dict[str, Any]:
        return {
            "worker": self.name,
            "device": str(self.loaded.device),
            "model": self.loaded.name,
            "quantization": self.loaded.quantization,
            "weight_bytes": self.loaded.weight_bytes,
            "ram_before_load": self.ram_before_load,
            "ram_left": self.ram_left,
            "load_s": self.loaded.load_s,
            "swept_dirs": len(self.swept),
            "max_sequences": self.cfg.batch.sequences,
            "node_workers": self.node_workers,
            "device_kv_budget_bytes": self.device_budget,
            "host_kv_budget_bytes": self.host_budget,
            "attention": self.attention,
            "sdpa": self.sdpa,
            "graphs": self.graphs,
        }

    def progress(self, call_id: str) -> float | None:
        """Seconds since call `call_id`'s pass began to run (None while it waits, queued behind
        batch-mates, not yet started or ended). Answered from a thread of its own, so a busy worker answers."""
        clock = self._calls.get(call_id)
        return None if clock is None else clock.running_s()

    def tokens_decoded(self) -> int:
        """Tokens this worker's decode steps have made since it started, asked while tasks run (live tok/s)."""
        return self.engine.plan.tokens_decoded

    # -- planning --------------------------------------------------------------------------------
    def _max_new_tokens(self, task: Task) -> int:
        return int(task.overrides.get("max_new_tokens", self.cfg.summarize.max_new_tokens))

    def _instruction(self, task: Task) -> str:
        return str(task.overrides.get("prompt", self.cfg.summarize.prompt))

    def _outcome(self) -> CallOutcome:
        return CallOutcome(worker=self.name, model=self.loaded.name, quantization=self.loaded.quantization,
                           fallbacks=[])

    def _specs(self, task: Task, level: int, context_tokens: int, prompts: list[list[int]],
               final: bool) -> tuple[PassSpec, ...]:
        max_new_tokens = self._max_new_tokens(task)
        return tuple(PassSpec(task.task_id, task.doc_id, pass_key(self.fingerprint, ids, max_new_tokens),
                              self.fingerprint, level, i, context_tokens, tuple(ids), max_new_tokens, final)
                     for i, ids in enumerate(prompts))

    def plan(self, task: Task, context_tokens: int) -> CallOutcome:
        """The document's first level at `context_tokens`: read and tokenised once, cut into chunks (one
        pass when it fits). A document that does not load or fit fails (class input)."""
        started = time.perf_counter()
        try:
            text = load_task_text(task)
            prompts, input_tokens = self.summarizer.chunks(text, self._instruction(task), self._max_new_tokens(task),
                                                           context_tokens)
        except (DocumentError, ContextTooSmallError) as e:
            return self._outcome() | _failure(FailureClass.INPUT, type(e).__name__, str(e), started)
        plan = LevelPlan(self._specs(task, 0, context_tokens, prompts, len(prompts) == 1), (), input_tokens)
        return self._outcome() | CallOutcome(status="done", plan=plan)

    def plan_merge(self, task: Task, level: int, texts: list[str], context_tokens: int) -> CallOutcome:
        """Level `level`: the previous level's summaries `texts` grouped into merge passes."""
        started = time.perf_counter()
        try:
            groups, prompts = self.summarizer.merges(texts, self._instruction(task), self._max_new_tokens(task),
                                                     context_tokens)
        except ContextTooSmallError as e:
            return self._outcome() | _failure(FailureClass.INPUT, type(e).__name__, str(e), started)
        plan = LevelPlan(self._specs(task, level, context_tokens, prompts, len(groups) == 1),
                         tuple((g.start, g.stop) for g in groups))
        return self._outcome() | CallOutcome(status="done", plan=plan)

    # -- one pass --------------------------------------------------------------------------------
    def run_pass(self, spec: PassSpec, attempt: int, call_id: str = "") -> CallOutcome:
        """Run one pass on this worker's cache ladder; its outcome (never raises for an expected
        failure) holds its row when it finished. `attempt`: the document's (what a fault rule
        matches); `call_id` names the call for `progress`."""
        started = time.perf_counter()
        outcome = self._outcome()
        memory = StageMemory()
        clock = self._calls[call_id] = TaskClock()
        try:
            with _PeakRss() as rss:
                outcome |= self._first_rung_that_runs(spec, attempt, memory, clock, outcome["fallbacks"], started)
        finally:
            self._calls.pop(call_id, None)
        outcome.update(
            memory.row_fields(),
            peak_host_rss_bytes=max(rss.peak, memory.decode_peak_host_rss_bytes or 0),
            peak_device_bytes=memory.device_peak_bytes,
            load_host_rss_bytes=self.after_load.host_rss_bytes,
            load_device_bytes=self.after_load.device_bytes,
            host_used_fraction=memory.host_used_fraction,  # for the coordinator's memory alert
            device_used_fraction=memory.device_used_fraction,
            wall_s=time.perf_counter() - started,
        )
        return outcome

    def _rungs(self, spec: PassSpec) -> list[str]:
        if self.cfg.cache.strategy != "auto":
            return [self.cfg.cache.strategy]
        return plan_rungs(
            self.cfg.cache.ladder,
            kv_bytes(self.kv_shape, len(spec.prompt) + spec.max_new_tokens),
            self.device_budget,
            self.host_budget,
            self.loaded.device.type == "cpu",
        )

    def _first_rung_that_runs(self, spec: PassSpec, attempt: int, memory: StageMemory, clock: TaskClock,
                              fallbacks: list[str], started: float) -> CallOutcome:
        rungs = self._rungs(spec)
        last_error = ("OutOfMemoryError", "no cache rung fits the budgets")  # when the ladder is empty
        for i, rung in enumerate(rungs):
            try:
                return self._run_on(rung, spec, attempt, memory, clock)
            except Exception as e:  # noqa: BLE001 - classified below, reported to the coordinator
                if _is_setting_error(e):
                    return _failure(FailureClass.SETTING, type(e).__name__, str(e), started)
                if not _is_memory_error(e):
                    return _failure(FailureClass.TRANSIENT, type(e).__name__, str(e), started)
                # only what the result needs: the exception's frames would keep the failed cache alive
                last_error = (type(e).__name__, str(e))
            # out of the handler, so the failed rung's exception and everything it held are gone
            gc.collect()
            if self.loaded.device.type == "cuda":
                torch.cuda.empty_cache()
            fallbacks.append(cache_fallback_note(rung, rungs[i + 1] if i + 1 < len(rungs) else None, last_error[0]))
        return _failure(FailureClass.MEMORY, *last_error, started)

    def _run_on(self, rung: str, spec: PassSpec, attempt: int, memory: StageMemory, clock: TaskClock) -> CallOutcome:
        """The pass done on `rung` (in the worker's batch); raises what stops it there. A fault a test
        injects strikes the pass whose summary is the document's, once every pass before it was kept."""
        fault = fault_for(self.faults, spec.doc_id, attempt, rung, spec.context_tokens) if spec.final else None
        with self._scratch_dir(rung, spec, attempt) as offload_dir:
            run = RungAttempt(rung, self.cache_kit, self.engine, memory, clock, offload_dir, spec.doc_id, fault)
            generation = run.run(list(spec.prompt), spec.max_new_tokens)
        stats = run.cache_stats or {}
        row = PassRow(task_id=spec.task_id, doc_id=spec.doc_id, key=spec.key, fingerprint=spec.fingerprint,
                      level=spec.level, index=spec.index, context_tokens=spec.context_tokens,
                      prompt_tokens=len(spec.prompt), tokens=generation.tokens,
                      text=self.summarizer.decode(generation.tokens), stop_reason=str(generation.stop_reason),
                      worker=self.name, finished_at=time.time(), prefill_s=generation.ttft_s,
                      decode_s=generation.decode_s, batch_size=generation.batch_size)
        return CallOutcome(
            status="done", row=row, cache_strategy=rung,
            decode_row_steps=run.decode_steps, static_step_share=static_share(run.decode_steps),
            kv_bytes=stats.get("kv_bytes") or 0, kv_resident_peak_bytes=stats.get("kv_resident_peak_bytes") or 0,
            offload_bytes_written=stats.get("offload_bytes_written") or 0,
            offload_bytes_read=stats.get("offload_bytes_read") or 0,
            compression_ratio=stats.get("compression_ratio") if stats.get("offload_bytes_written") else None,
            kv_placement=run.placement.describe() if run.placement else None,
        )

    def _scratch_dir(self, rung: str, spec: PassSpec, attempt: int) -> AbstractContextManager[Path | None]:
        """The pass's scratch dir on a rung that offloads to disk, with its KV's bytes claimed on the
        disk (waiting for running passes that hold the room, as long as one may run); none on the others."""
        if not RUNGS[rung].needs_offload_dir:
            return nullcontext(None)
        return task_scratch(self.offload_root, self.job_id, spec.task_id, attempt,
                            claim_bytes=kv_bytes(self.kv_shape, len(spec.prompt) + spec.max_new_tokens),
                            wait_s=self.cfg.retry.task_timeout_s, pass_at=(spec.level, spec.index))


def _failure(cls: FailureClass, error_type: str, error: str, started: float) -> CallOutcome:
    return CallOutcome(status="failed", failure_class=cls.value, error_type=error_type, error=error,
                       wall_s=time.perf_counter() - started)
