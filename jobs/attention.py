"""Which decode-step attention a worker runs (`batch.attention`), as a plain function.

`auto` follows the measured table in docs/benchmarks.md ("Pooled or per-row attention"): on CUDA the
pooled step (one K/V write and one attention call per layer for every device-resident row: a step's
kernel launches stop growing with the batch); on the CPU the per-row step, which attends each row's
cache in place and measured faster there. The pool only holds full-attention layers, so a model with
sliding-window layers runs per row whatever the setting.
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
