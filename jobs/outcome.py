"""The contract between a worker and the coordinator: what one attempt at a task returns.

A worker returns a `TaskOutcome`; the coordinator reads it (and builds the result row from it) but
never changes it. Keys are the result row's columns the worker knows, plus how an attempt failed.
"""

from __future__ import annotations

from typing import TypedDict


class CacheStats(TypedDict):
    """A cache's figures for the result row (None where a strategy cannot tell)."""

    kv_bytes: int | None  # the most valid K/V bytes the cache held
    kv_resident_peak_bytes: int | None  # the most bytes it held on the device (buffers included)
    offload_bytes_written: int | None  # bytes written off the device (to host RAM or block files)
    offload_bytes_read: int | None  # bytes read back
    compression_ratio: float | None  # raw / stored bytes of block files (zstd); None when nothing was compressed


class TaskOutcome(TypedDict, total=False):
    """One attempt's outcome. Always: `status`, `worker`, `model`, `fallbacks`, `wall_s`."""

    status: str  # "done" | "failed"
    failure_class: str  # jobs.policy.FailureClass, when failed: what the coordinator does next
    error_type: str  # the exception's type name, when failed
    error: str  # its message
    worker: str  # "host:pid"
    model: str
    quantization: str  # how the model's weights are quantized: ModelConfig.quantization, or the checkpoint's
    fallbacks: list[str]  # cache rungs this attempt moved down, as notes (str of a jobs.fallback.Fallback)
    summary: str
    input_tokens: int
    output_tokens: int
    chunks: int  # first-level chunks (1: one pass)
    passes: int  # generate passes the summary took: its chunks, then the merges of their summaries
    passes_reused: int  # of them, finished by an earlier attempt or run and read back (storage/passes.py)
    cache_strategy: str  # the rung that ran it
    stop_reason: str  # why the summary's pass ended: jobs.stopping.StopReason
    ttft_s: float
    decode_tokens_per_s: float
    prefill_s: float
    decode_s: float
    batch_size: float  # mean sequences sharing its decode steps
    padding_share: float  # padded share of them (0: ragged steps)
    kv_bytes: int
    kv_resident_peak_bytes: int
    offload_bytes_written: int
    offload_bytes_read: int
    compression_ratio: float | None
    kv_placement: str | None
    wall_s: float
    peak_host_rss_bytes: int
    peak_device_bytes: int | None
    load_host_rss_bytes: int
    load_device_bytes: int | None
    prefill_host_rss_bytes: int | None
    prefill_device_bytes: int | None
    decode_peak_host_rss_bytes: int | None
    decode_peak_device_bytes: int | None
    host_used_fraction: float | None  # for the coordinator's memory alert
    device_used_fraction: float | None
