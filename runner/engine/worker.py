"""The worker: holds one model and summarises several tasks at once (a Ray actor in a batch).

Each task runs in a thread of its own (the actor takes `batch.max_sequences` calls at a time); its
passes go to the worker's one `BatchEngine`, which decodes the sequences of every task in flight
together. A task runs in three stages: build its request (read the document, settings and
overrides), find the first cache rung that runs it, and produce its outcome. The worker owns the
cache ladder: a task starts on the first rung the planner says fits, and a device OOM (real, from
the budget guard, or a full offload disk) moves it to the next rung at once. What is left
(transient errors, shorter contexts) is the coordinator's business, so the worker reports a
failure's class instead of retrying it. The worker never writes the job folder: the passes an
earlier attempt finished come in with the call, and those it finishes go back to the coordinator
(`progress` while the call runs, the rest with its outcome), which records them.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from jobs.attention import attention_path, static_step_on
from jobs.chunking import ContextTooSmallError
from jobs.config import ConfigError, JobConfig
from jobs.documents import DocumentError, load_task_text
from jobs.faults import FAULTS_ENV, FaultRule, fault_for
from jobs.kvplan import estimated_tokens, kv_bytes, plan_rungs
from jobs.node_share import workers_per_device
from jobs.outcome import DealtPass, TaskOutcome, static_share
from jobs.policy import FailureClass, cache_fallback_note
from jobs.rungs import RUNGS
from jobs.task import Task
from runner.engine.batch_engine import BatchEngine, TaskClock
from runner.engine.cache_recipe import CacheKit
from runner.engine.kvcache import ResidentMeter, kv_shape, ram_left_by_weights, resolve_budgets
from runner.engine.kvcache.pool import KVPool
from runner.engine.model_loader import load_model
from runner.engine.pass_book import PassBook, pass_key, settings_fingerprint
from runner.engine.probes import StageMemory, memory_snapshot
from runner.engine.rung_attempt import CacheTotals, RungAttempt
from runner.engine.sdpa import choose_sdpa
from runner.engine.static_step import StaticStep, bucket
from runner.engine.summarize import Summarizer, Summary
from storage.passes import PassRow
from storage.scratch import (
    ScratchSpaceError,
    ensure_offload_root,
    sweep_orphans,
    task_scratch,
)


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


@dataclass(frozen=True)
class TaskRequest:
    """What one task asks of the model: the first stage of `SummaryWorker.run`."""

    task: Task
    attempt: int
    context_tokens: int
    text: str
    max_new_tokens: int
    instruction: str
    passes: PassBook
    """Its passes finished before (handed in) and now (handed back)."""
    dealt_pass: DealtPass | None = None
    """Set when the call runs one of the task's passes alone, dealt out by the coordinator."""
    clock: TaskClock = field(default_factory=TaskClock)
    """Started when the task's first sequence begins to run: what `progress` reports."""


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
        self.summarizer = Summarizer(self.loaded, self.cfg.summarize.chunk_overlap_tokens,
                                     self.cfg.summarize.trim_to_sentence)
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
        self._calls: dict[str, TaskRequest] = {}  # call id -> the task in flight under it

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

    def progress(self, call_id: str, wait_s: float = 0.0) -> tuple[float | None, list[PassRow]]:
        """Seconds since call `call_id`'s first sequence began to run (None while it waits, queued
        behind batch-mates, not yet started or ended), and the passes it finished since the last
        answer, waiting up to `wait_s` for one (or the call's end). Answered from a thread of its
        own, so a busy worker answers."""
        request = self._calls.get(call_id)
        if request is None:
            return None, []
        passes = request.passes.handed_back(wait_s)
        return request.clock.running_s(), passes

    def tokens_decoded(self) -> int:
        """Tokens this worker's decode steps have made since it started, asked while tasks run (live tok/s)."""
        return self.engine.plan.tokens_decoded

    def first_level(self, task: Task, context_tokens: int) -> list[DealtPass]:
        """The task's chunks at `context_tokens` as passes the coordinator can deal out to any worker;
        none for a document that does not load or fit (its own attempt says why)."""
        max_new_tokens = self._max_new_tokens(task)
        try:
            text = load_task_text(task)
            first = self.summarizer.first_level(text, self._instruction(task), max_new_tokens, context_tokens)
        except (DocumentError, ContextTooSmallError):
            return []
        return [DealtPass(i, pass_key(self.fingerprint, ids, max_new_tokens), ids)
                for i, ids in enumerate(first.prompts)]

    def run(self, task: Task, attempt: int, context_tokens: int, kept: list[PassRow], call_id: str = "",
            dealt: set[str] | None = None, dealt_pass: DealtPass | None = None,
            ) -> tuple[TaskOutcome, list[PassRow]]:
        """Summarise one task, reusing the passes in `kept` that it would run again (`dealt`: the
        keys of those that ran dealt out for this attempt); or with `dealt_pass`, run that one pass of
        it alone, on this worker's cache ladder. Returns an outcome (never raises for an expected
        failure) and the passes finished that `progress` has not handed back yet. `call_id` names the
        call for `progress`."""
        started = time.perf_counter()
        outcome = TaskOutcome(worker=self.name, model=self.loaded.name, quantization=self.loaded.quantization,
                              fallbacks=[])
        try:
            request = self._request(task, attempt, context_tokens, kept, dealt, dealt_pass)
        except DocumentError as e:
            return outcome | _failure(FailureClass.INPUT, type(e).__name__, str(e), started), []
        memory = StageMemory()
        self._calls[call_id] = request
        try:
            with _PeakRss() as rss:
                outcome |= self._first_rung_that_runs(request, memory, outcome["fallbacks"], started)
        finally:
            self._calls.pop(call_id, None)
            rest = request.passes.close()
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
        return outcome, rest

    # -- stage 1: the request ------------------------------------------------------------------
    def _max_new_tokens(self, task: Task) -> int:
        return int(task.overrides.get("max_new_tokens", self.cfg.summarize.max_new_tokens))

    def _instruction(self, task: Task) -> str:
        return str(task.overrides.get("prompt", self.cfg.summarize.prompt))

    def _request(self, task: Task, attempt: int, context_tokens: int, kept: list[PassRow],
                 dealt: set[str] | None, dealt_pass: DealtPass | None) -> TaskRequest:
        return TaskRequest(
            task=task, attempt=attempt, context_tokens=context_tokens,
            text="" if dealt_pass is not None else load_task_text(task),
            max_new_tokens=self._max_new_tokens(task), instruction=self._instruction(task),
            passes=PassBook(kept, task.task_id, task.doc_id, context_tokens, self.fingerprint,
                            self.summarizer.decode, self.name, dealt),
            dealt_pass=dealt_pass,
        )

    # -- stage 2: the first rung that runs it --------------------------------------------------
    def _rungs(self, request: TaskRequest) -> list[str]:
        if self.cfg.cache.strategy != "auto":
            return [self.cfg.cache.strategy]
        tokens = estimated_tokens(request.task.n_chars, request.max_new_tokens, request.context_tokens)
        return plan_rungs(
            self.cfg.cache.ladder,
            kv_bytes(self.kv_shape, tokens),
            self.device_budget,
            self.host_budget,
            self.loaded.device.type == "cpu",
        )

    def _first_rung_that_runs(self, request: TaskRequest, memory: StageMemory, fallbacks: list[str],
                              started: float) -> TaskOutcome:
        rungs = self._rungs(request)
        last_error = ("OutOfMemoryError", "no cache rung fits the budgets")  # when the ladder is empty
        for i, rung in enumerate(rungs):
            try:
                return self._summarize_on(rung, request, memory)
            except ContextTooSmallError as e:
                return _failure(FailureClass.INPUT, type(e).__name__, str(e), started)
            except Exception as e:  # noqa: BLE001 - classified below, reported to the coordinator
                if _is_setting_error(e):
                    return _failure(FailureClass.SETTING, type(e).__name__, str(e), started)
                if not _is_memory_error(e):
                    return _failure(FailureClass.TRANSIENT, type(e).__name__, str(e), started)
                # only what the result needs: the exception's frames would keep the failed cache alive
                last_error = (type(e).__name__, str(e))
            # out of the handler, so the failed rung's exception and everything it held are gone
            self._release_memory()
            fallbacks.append(cache_fallback_note(rung, rungs[i + 1] if i + 1 < len(rungs) else None, last_error[0]))
        return _failure(FailureClass.MEMORY, *last_error, started)

    def _summarize_on(self, rung: str, request: TaskRequest, memory: StageMemory) -> TaskOutcome:
        """The task done on `rung` (its passes in the worker's batch); raises what stops it there."""
        task, dealt_pass = request.task, request.dealt_pass
        # a fault a test injects strikes the task's own attempt, as in a batch that deals nothing out
        fault = None if dealt_pass else fault_for(self.faults, task.doc_id, request.attempt, rung, request.context_tokens)
        with self._scratch_dir(rung, request) as offload_dir:
            attempt = RungAttempt(rung, self.cache_kit, self.engine, memory, request.clock, offload_dir,
                                  task.doc_id, fault, request.passes)
            if dealt_pass is None:
                summary = self.summarizer.summarize(
                    request.text, request.instruction, request.max_new_tokens, request.context_tokens, attempt
                )
            else:
                [generation] = attempt([dealt_pass.prompt], request.max_new_tokens, first_index=dealt_pass.index)
                summary = Summary(self.summarizer.decode(generation.tokens), len(dealt_pass.prompt),
                                  generation.output_tokens, 1, [generation], str(generation.stop_reason))
        return _done(rung, summary, attempt.totals)

    def _scratch_dir(self, rung: str, request: TaskRequest) -> AbstractContextManager[Path | None]:
        """The task's scratch dir on a rung that offloads to disk, with its KV's bytes claimed on the
        disk (waiting for running tasks that hold the room, as long as one may run); none on the others."""
        if not RUNGS[rung].needs_offload_dir:
            return nullcontext(None)
        return task_scratch(self.offload_root, self.job_id, request.task.task_id, request.attempt,
                            claim_bytes=kv_bytes(self.kv_shape, request.context_tokens),
                            wait_s=self.cfg.retry.task_timeout_s,
                            dealt_pass=request.dealt_pass.index if request.dealt_pass else None)

    def _release_memory(self) -> None:
        gc.collect()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()


# -- stage 3: the outcome ------------------------------------------------------------------------
def _done(rung: str, summary: Summary, totals: CacheTotals) -> TaskOutcome:
    return {
        "status": "done",
        "summary": summary.text,
        "summary_tail": summary.tail,
        "input_tokens": summary.input_tokens,
        "output_tokens": summary.output_tokens,
        "chunks": summary.chunks,
        "cache_strategy": rung,
        "stop_reason": summary.stop_reason,
        "ttft_s": summary.ttft_s,
        "decode_tokens_per_s": summary.decode_tokens_per_s,
        "prefill_s": sum(p.ttft_s for p in summary.run_passes),
        "decode_s": sum(p.decode_s for p in summary.run_passes),
        "passes": len(summary.passes),
        "passes_reused": summary.reused_passes,
        "batch_size": summary.batch_size,
        "padding_share": 0.0,  # ragged decode steps: every row attends to its own length, nothing is padded
        "decode_row_steps": totals.decode_steps,
        "static_step_share": static_share(totals.decode_steps),
        "kv_bytes": totals.kv_bytes,
        "kv_resident_peak_bytes": totals.kv_resident_peak_bytes,
        "offload_bytes_written": totals.offload_bytes_written,
        "offload_bytes_read": totals.offload_bytes_read,
        "compression_ratio": totals.compression_ratio,
        "kv_placement": totals.placement.describe() if totals.placement else None,
    }


def _failure(cls: FailureClass, error_type: str, error: str, started: float) -> TaskOutcome:
    return {
        "status": "failed",
        "failure_class": cls.value,
        "error_type": error_type,
        "error": error,
        "wall_s": time.perf_counter() - started,
    }
