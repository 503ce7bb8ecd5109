"""The contract between a worker and the coordinator: what one pass returns, and a document's outcome.

Once a document ends, the rows and `CallOutcome`s of its passes fold into its `TaskOutcome`
(`fold_passes`), whose keys are the result row's columns, plus how a call failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from jobs.passes import LevelPlan, PassRow
from jobs.stopping import StopReason
from jobs.summaries import trim_to_sentence


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
    """A document's outcome (or one pass's, `CallOutcome`). Always: `status`, `worker`, `model`, `fallbacks`."""

    status: str  # "done" | "failed"
    failure_class: str  # jobs.policy.FailureClass, when failed: what the coordinator does next
    error_type: str  # the exception's type name, when failed
    error: str  # its message
    worker: str  # "host:pid"
    model: str
    quantization: str  # how the model's weights are quantized: ModelConfig.quantization, or the checkpoint's
    fallbacks: list[str]  # cache rungs (and contexts) moved down, as notes (str of a jobs.fallback.Fallback)
    summary: str
    summary_tail: str  # what followed the summary's last sentence when its pass ran out of tokens (jobs.summaries)
    input_tokens: int
    output_tokens: int
    chunks: int  # first-level chunks (1: one pass)
    passes: int  # generate passes the summary took: its chunks, then the merges of their summaries
    passes_reused: int  # of them, kept by an earlier run and read back (storage/passes.py)
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


class CallOutcome(TaskOutcome, total=False):
    """What one call of a worker returns: a pass's outcome (its row when it finished, its cache and memory
    figures) or a plan's (the level it planned)."""

    row: PassRow
    plan: LevelPlan


_ADDED_UP = ("offload_bytes_written", "offload_bytes_read")
_MOST = ("kv_bytes", "kv_resident_peak_bytes", "peak_host_rss_bytes", "peak_device_bytes", "prefill_host_rss_bytes",
         "prefill_device_bytes", "decode_peak_host_rss_bytes", "decode_peak_device_bytes", "host_used_fraction",
         "device_used_fraction")
_ANY = ("worker", "model", "quantization", "load_host_rss_bytes", "load_device_bytes", "kv_placement")


def fold_passes(tree: list[PassRow], ran: Mapping[str, Mapping[str, Any]], chunks: int, input_tokens: int,
                worker: Mapping[str, Any], trim: bool) -> TaskOutcome:
    """A finished document's outcome, folded from its passes (`tree`, level by level, the last its
    summary's) and the outcomes of those run in this batch (`ran`, by key; the others were read back).
    `worker`: what a worker says of itself, for a document whose every pass was read back. `trim`: a
    summary whose pass ran out of tokens ends at its last complete sentence (jobs.summaries)."""
    final = tree[-1]
    outcomes = [ran[row["key"]] for row in tree if row["key"] in ran]
    run_rows = [row for row in tree if row["key"] in ran]
    summary, tail = (trim_to_sentence(final["text"]) if trim and final["stop_reason"] == StopReason.LENGTH
                     else (final["text"], ""))
    merged = TaskOutcome(status="done", summary=summary, summary_tail=tail, stop_reason=final["stop_reason"],
                         chunks=chunks, input_tokens=input_tokens, output_tokens=len(final["tokens"]),
                         passes=len(tree), passes_reused=len(tree) - len(run_rows), padding_share=0.0)
    merged["fallbacks"] = list(dict.fromkeys(note for o in outcomes for note in o.get("fallbacks", [])))
    for key in _ANY:
        found = (o[key] for o in reversed(outcomes) if o.get(key) is not None)  # type: ignore[literal-required]
        merged[key] = next(found, worker.get(key))  # type: ignore[literal-required]
    merged["cache_strategy"] = (ran.get(final["key"]) or (outcomes[-1] if outcomes else {})).get("cache_strategy")
    for key in _ADDED_UP:
        merged[key] = sum(o.get(key) or 0 for o in outcomes)  # type: ignore[literal-required]
    for key in _MOST:
        found = (o[key] for o in outcomes if o.get(key) is not None)  # type: ignore[literal-required]
        merged[key] = max(found, default=None)  # type: ignore[literal-required]
    stored = sum(o.get("offload_bytes_written") or 0 for o in outcomes if o.get("compression_ratio"))
    raw = sum((o.get("offload_bytes_written") or 0) * (o.get("compression_ratio") or 0) for o in outcomes)
    merged["compression_ratio"] = raw / stored if stored else None
    steps = no_steps()
    for o in outcomes:
        steps = add_steps(steps, o.get("decode_row_steps") or no_steps())
    merged["decode_row_steps"], merged["static_step_share"] = steps, static_share(steps)
    prefill = [row["prefill_s"] or 0.0 for row in run_rows]
    decode = [row["decode_s"] or 0.0 for row in run_rows]
    decoded = [max(len(row["tokens"]) - 1, 0) for row in run_rows]
    merged["ttft_s"] = prefill[0] if prefill else 0.0
    merged["prefill_s"], merged["decode_s"] = sum(prefill), sum(decode)
    merged["decode_tokens_per_s"] = sum(decoded) / sum(decode) if sum(decode) > 0 else 0.0
    weighted = sum((row["batch_size"] or 1.0) * n for row, n in zip(run_rows, decoded))
    merged["batch_size"] = weighted / sum(decoded) if sum(decoded) else 1.0
    return merged
