"""The contract between a worker and the coordinator: what one attempt at a task returns.

A worker returns a `TaskOutcome`; the coordinator reads it (and builds the result row from it) but
never changes it. Keys are the result row's columns the worker knows, plus how an attempt failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class CacheStats(TypedDict):
    """A cache's figures for the result row (None where a strategy cannot tell)."""

    kv_bytes: int | None  # the most valid K/V bytes the cache held
    kv_resident_peak_bytes: int | None  # the most bytes it held on the device (buffers included)
    offload_bytes_written: int | None  # bytes written off the device (to host RAM or block files)
    offload_bytes_read: int | None  # bytes read back
    compression_ratio: float | None  # raw / stored bytes of block files (zstd); None when nothing was compressed


class DecodeSteps(TypedDict):
    """A task's decode row-steps (one sequence in one decode step) over the passes its attempt ran, by
    the path they took: through the static step (runner/engine/static_step.py) or eagerly, and why."""

    static: int
    eager: dict[str, int]  # why (runner.engine.static_step.Eager) -> row-steps
    ahead: int  # of the static ones, those launched before the step before was read (their input from the device)


def no_steps() -> DecodeSteps:
    return {"static": 0, "eager": {}, "ahead": 0}


def add_steps(total: DecodeSteps, more: DecodeSteps) -> DecodeSteps:
    """Both tallies together (a job.log line written before `ahead` was counted has none)."""
    eager = dict(total["eager"])
    for why, count in more["eager"].items():
        eager[why] = eager.get(why, 0) + count
    return {"static": total["static"] + more["static"], "eager": eager,
            "ahead": total.get("ahead", 0) + more.get("ahead", 0)}


def static_share(steps: DecodeSteps) -> float | None:
    """Row-steps through the static step over all of them; None without a decode step."""
    every = steps["static"] + sum(steps["eager"].values())
    return steps["static"] / every if every else None


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
    summary_tail: str  # what followed the summary's last sentence when its pass ran out of tokens (jobs.summaries)
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
    decode_row_steps: DecodeSteps  # its decode row-steps by path: job.log's task_done line
    static_step_share: float | None  # of them, the share through the static step (None: no decode step)
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


@dataclass(frozen=True)
class DealtPass:
    """One pass of a task's first level (a chunk), as the coordinator deals it out to any worker."""

    index: int  # its place among the chunks
    key: str  # its name in the job folder (runner/engine/pass_book.py)
    prompt: list[int]  # its prompt's token ids


_ADDED_UP = ("offload_bytes_written", "offload_bytes_read")
_MOST = ("kv_bytes", "kv_resident_peak_bytes", "peak_host_rss_bytes", "peak_device_bytes", "prefill_host_rss_bytes",
         "prefill_device_bytes", "decode_peak_host_rss_bytes", "decode_peak_device_bytes")


def with_dealt_passes(outcome: TaskOutcome, dealt: list[TaskOutcome]) -> TaskOutcome:
    """The task's outcome with the cache figures of its passes that ran dealt out (each an outcome of its
    own): the bytes moved add up, a peak is the most any of them reached, their decode row-steps add up
    (the static step's share is of them all), and their moves down the cache ladder join the task's
    fallbacks (each note once)."""
    merged = TaskOutcome(**outcome)
    every = [outcome, *dealt]
    for key in _ADDED_UP:
        merged[key] = sum(o.get(key) or 0 for o in every)  # type: ignore[literal-required]
    for key in _MOST:
        values = [o[key] for o in every if o.get(key) is not None]  # type: ignore[literal-required]
        merged[key] = max(values) if values else None  # type: ignore[literal-required]
    stored = sum(o.get("offload_bytes_written") or 0 for o in every if o.get("compression_ratio"))
    raw = sum((o.get("offload_bytes_written") or 0) * (o.get("compression_ratio") or 0) for o in every)
    merged["compression_ratio"] = raw / stored if stored else None
    steps = no_steps()
    for o in every:
        steps = add_steps(steps, o.get("decode_row_steps") or no_steps())
    merged["decode_row_steps"], merged["static_step_share"] = steps, static_share(steps)
    merged["fallbacks"] = list(dict.fromkeys([*outcome.get("fallbacks", []),
                                              *(note for o in dealt for note in o.get("fallbacks", []))]))
    return merged
