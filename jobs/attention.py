"""Which decode-step attention a worker runs (`batch.attention`, `batch.static_step`), as plain functions.

`auto` follows the measured tables in docs/benchmarks.md ("Pooled or per-row attention on the CPU",
"Step ops"): the pooled step on CUDA, whose kernel launches per step do not grow with the batch, and
on the CPU, where it decodes faster than the per-row step at every shape measured
(bench/decode_revisions.py, SmolLM2-135M, 2 threads): 1.22x at 16 x 500 tokens, 1.34x at 8 x 3,000,
and 1.18x on a mixed batch of 16 rows of 300-3,000 tokens, which it attends in runs of like lengths
(runner/engine/pooled_attention.py; with one call a layer, padding every row to the longest, it was
0.96-0.98x). A device that has not been measured (not in `AUTO`) runs per row. The pool only holds
full-attention layers, so a model with sliding-window layers runs per row whatever the setting.
"""

from __future__ import annotations

from typing import Literal, get_args

AttentionPath = Literal["pooled", "per-row"]
AttentionSetting = Literal["auto", "pooled", "per-row"]

AUTO: dict[str, AttentionPath] = {"cuda": "pooled", "cpu": "pooled"}
"""`auto`'s path by torch device type, as measured (docs/benchmarks.md)."""


def attention_path(setting: str, device_type: str, windowed_layers: bool) -> AttentionPath:
    """The path a worker takes for `batch.attention` = `setting` on a `device_type` device."""
    if setting not in get_args(AttentionSetting):
        raise ValueError(f"batch.attention: {setting!r} is not one of {', '.join(get_args(AttentionSetting))}")
    if windowed_layers:
        return "per-row"
    if setting == "auto":
        return AUTO.get(device_type, "per-row")
    return "pooled" if setting == "pooled" else "per-row"


def static_step_on(setting: str, device_type: str, path: AttentionPath) -> bool:
    """Whether a worker runs its pooled steps in static buffers (`batch.static_step` = `setting`):
    `auto` on CUDA, where the host's ops per step, not the device, bound a step (issue 36); never
    off the pooled path, whose KV pool the static step writes."""
    return path == "pooled" and (setting == "on" or (setting == "auto" and device_type == "cuda"))
