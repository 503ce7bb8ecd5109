"""Which decode-step attention a worker runs (`batch.attention`), as a plain function.

`auto` follows the measured table in docs/benchmarks.md ("Pooled or per-row attention on the CPU"
and "Step ops"): on CUDA the pooled step, whose kernel launches per step do not grow with the batch;
on the CPU the per-row step, which attends each row's own cache in place. On the CPU the pooled step
measured no slower at equal prompt lengths, but it attends every row up to the longest row's length
(the pool pads), which a real mix of document lengths pays for and which has not been measured yet.
The pool only holds full-attention layers, so a model with sliding-window layers runs per row
whatever the setting.
"""

from __future__ import annotations

from typing import Literal

AttentionPath = Literal["pooled", "per-row"]


def attention_path(setting: str, device_type: str, windowed_layers: bool) -> AttentionPath:
    """The path a worker takes for `batch.attention` = `setting` on a `device_type` device."""
    if windowed_layers:
        return "per-row"
    if setting == "auto":
        return "pooled" if device_type == "cuda" else "per-row"
    return "pooled" if setting == "pooled" else "per-row"
