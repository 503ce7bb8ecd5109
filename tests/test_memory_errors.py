"""What counts as running out of memory: the errors that move a task down the cache ladder.

torch raises `torch.OutOfMemoryError` only from its device allocator. A failed pinned host
allocation (`cudaHostAlloc`, behind every tiered cache's RAM tail on CUDA) comes out of
`C10_CUDA_CHECK` as a `torch.AcceleratorError` (a `RuntimeError`) reading "CUDA error: out of
memory", and a failed CPU allocation as a plain `RuntimeError` from `DefaultCPUAllocator`. Each is
classed as memory here, on the real exception types with the messages torch gives; the CPU one is
also provoked for real, through the worker, where it must move the task down the ladder.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import pytest
import torch

from jobs.config import load_config
from jobs.task import Task
from runner.engine.kvcache import KVBudgetExceeded
from runner.engine.worker import SummaryWorker, _is_memory_error
from storage.scratch import ScratchSpaceError
from tests.helpers.cli import TINY_CONFIG
from tests.helpers.summarize import summarize

# torch's own text for a failed CUDA call (c10/cuda/CUDAException.cpp), here for cudaErrorMemoryAllocation
_CUDA_CHECK_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def _cpu_allocation_error() -> RuntimeError:
    """What a real failed CPU allocation raises (more bytes than any address space holds)."""
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("allocating 4 EiB succeeded")


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: out of memory" + _CUDA_CHECK_TAIL),  # cudaHostAlloc of pinned memory
    RuntimeError("CUDA error: out of memory" + _CUDA_CHECK_TAIL),  # the same from torch before AcceleratorError
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    KVBudgetExceeded("resident device KV would reach 10 bytes, over the budget of 5 bytes"),
    ScratchSpaceError("the offload root has 1 byte free", 1, 10),
    OSError(errno.ENOSPC, "No space left on device"),
], ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}")
def test_allocation_failures_are_memory_errors(error: BaseException) -> None:
    assert _is_memory_error(error)


def test_a_real_failed_cpu_allocation_is_a_memory_error() -> None:
    error = _cpu_allocation_error()
    assert type(error) is RuntimeError and "can't allocate memory" in str(error)  # what torch really raised
    assert _is_memory_error(error)


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered" + _CUDA_CHECK_TAIL),
    RuntimeError("pin_memory=True requires a CUDA or other accelerator backend; no pinned memory allocator "
                 "is available on this system."),
    RuntimeError("shape '[2, 3]' is invalid for input of size 5"),
    OSError(errno.EIO, "Input/output error"),
    ValueError("out of memory"),  # not an allocator's error, whatever it says
], ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}")
def test_other_errors_are_not_memory_errors(error: BaseException) -> None:
    assert not _is_memory_error(error)


def test_a_task_whose_allocation_really_fails_moves_down_the_ladder(tmp_path: Path) -> None:
    """`dynamic` reserves the whole pass up front; a pass of 10^15 tokens is more than any address
    space, so the CPU allocator refuses it for real (no budget guard in the way: the budget is set
    far above it). The task must move to tiered-disk, not come back as a transient failure to retry."""
    config = load_config(TINY_CONFIG, [
        "cache.strategy=auto", "cache.ladder=[dynamic, tiered-disk]",
        f"cache.device_kv_budget_bytes={1 << 62}", "summarize.context_tokens=2000000000000000",
    ])
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), threads=1)
    text = "a short document. " * 20
    task = Task(task_id="t000001", doc_id="doc-1", source_type="text", source=text, n_chars=len(text),
                n_bytes=len(text.encode()), sha256=hashlib.sha256(text.encode()).hexdigest(),
                overrides={"max_new_tokens": 10**15}, meta={})
    try:
        outcome = summarize(worker, task, config.summarize.context_tokens)
    finally:
        worker.engine.close()
    # the dynamic rung failed in the CPU allocator (a RuntimeError), and that moved the task on, to
    # tiered-disk, whose offload disk cannot hold such a pass either: the ladder ran out
    assert outcome["fallbacks"] == ["cache:dynamic->tiered-disk (RuntimeError)",
                                    "cache:tiered-disk->exhausted (ScratchSpaceError)"], outcome
    assert outcome["status"] == "failed" and outcome["failure_class"] == "memory", outcome
