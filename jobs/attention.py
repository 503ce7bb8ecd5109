"""Which decode-step attention a worker runs (`batch.attention`), as a plain function.

`auto` follows the measured tables in docs/benchmarks.md ("Pooled or per-row attention on the CPU",
"Step ops"): on CUDA the pooled step, whose kernel launches per step do not grow with the batch; on
the CPU the per-row step, which attends each row's own cache in place, unpadded. On the CPU the
pooled step is faster when the rows are all of one length (1.19x at 16 x 500 tokens, 1.34x at
8 x 3,000, bench/decode_revisions.py), but it attends every row up to the longest row's length, and
on a mixed batch (16 rows of 300-3,000 tokens, the spread of a real mix of documents) it measured
0.96-0.98x the per-row step: no faster, so the CPU keeps the zero-copy per-row path. A device that
has not been measured (not in `AUTO`) runs per row. The pool only holds full-attention layers, so a
model with sliding-window layers runs per row whatever the setting.
"""

from __future__ import annotations

from typing import Literal, get_args

AttentionPath = Literal["pooled", "per-row"]
AttentionSetting = Literal["auto", "pooled", "per-row"]

AUTO: dict[str, AttentionPath] = {"cuda": "pooled", "cpu": "per-row"}
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
