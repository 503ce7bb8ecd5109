"""Which decode-step attention a worker runs (`batch.attention`), as a plain function.

`auto` follows the measured tables in docs/benchmarks.md ("Pooled or per-row attention on the CPU",
"Step ops"): on CUDA the pooled step, whose kernel launches per step do not grow with the batch; on
the CPU, for now, the per-row step, which attends each row's own cache in place, unpadded. On the
CPU the pooled step is faster when the rows are all of one length (1.22x at 16 x 500 tokens, 1.34x
at 8 x 3,000, bench/decode_revisions.py). On a mixed batch (16 rows of 300-3,000 tokens) it was
0.96-0.98x while one attention call read every row up to the longest row's length, and 1.18x once the
step attended in runs of like lengths (runner/engine/pooled_attention.py, one quiet run): the
measurement now says pooled; the CPU default moves once the whole test suite has run with it. A device
that has not been measured (not in `AUTO`) runs per row. The pool only holds full-attention layers, so a
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
