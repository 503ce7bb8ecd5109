"""Which decode-step attention a worker runs (`batch.attention`, `batch.static_step`), as plain functions.

`auto` follows docs/benchmarks.md ("Pooled or per-row attention on the CPU", "Step ops"): pooled on CUDA
and the CPU, per row on a device not in `AUTO`. The pool holds only full-attention layers, so a model with
sliding-window layers runs per row whatever the setting.
"""

from __future__ import annotations

from typing import Literal

AttentionPath = Literal["pooled", "per-row"]

AUTO: dict[str, AttentionPath] = {"cuda": "pooled", "cpu": "pooled"}
"""`auto`'s path by torch device type, as measured (docs/benchmarks.md)."""


def attention_path(setting: str, device_type: str, windowed_layers: bool) -> AttentionPath:
    """The path a worker takes for `batch.attention` = `setting` on a `device_type` device."""
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
