"""Memory at each stage of a task: after model load, after prefill, peak while decoding (device and host).

Operators size batches by where memory goes, so the worker records it per stage instead of one
task-wide peak. The engine knows each stage's boundary (it runs every prefill and decode step),
so it records them for every task whose sequences it runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch


@dataclass(frozen=True)
class MemorySnapshot:
    host_rss_bytes: int
    device_bytes: int | None  # allocated by torch on the device; None on a CPU device
    host_used_fraction: float  # of the machine's RAM, all processes
    device_used_fraction: float | None  # of the device's memory, all processes


def memory_snapshot(device: torch.device) -> MemorySnapshot:
    """This process's RSS and torch's device allocation, plus how full the machine and device are."""
    device_bytes = device_fraction = None
    if device.type == "cuda":
        device_bytes = torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        device_fraction = 1 - free / total
    return MemorySnapshot(
        host_rss_bytes=psutil.Process().memory_info().rss,
        device_bytes=device_bytes,
        host_used_fraction=psutil.virtual_memory().percent / 100,
        device_used_fraction=device_fraction,
    )


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass
class StageMemory:
    """Per-task memory by stage, taken by the engine that runs the task's passes: after each prefill,
    and at each decode step (the peak). On CUDA the device figure is torch's allocation at that moment:
    sequences share the device, so a peak counter would mix in their batch-mates' transients."""

    prefill_host_rss_bytes: int | None = None
    prefill_device_bytes: int | None = None
    decode_peak_host_rss_bytes: int | None = None
    decode_peak_device_bytes: int | None = None
    host_used_fraction: float | None = None  # highest reading while the task ran
    device_used_fraction: float | None = None

    def observe(self, snap: MemorySnapshot) -> None:
        """How full the machine and device are now (a pass's end): the highest reading is kept."""
        self.host_used_fraction = _max(self.host_used_fraction, snap.host_used_fraction)
        self.device_used_fraction = _max(self.device_used_fraction, snap.device_used_fraction)

    def prefill_done(self, snap: MemorySnapshot) -> None:
        self.observe(snap)
        self.prefill_host_rss_bytes = _max(self.prefill_host_rss_bytes, snap.host_rss_bytes)
        self.prefill_device_bytes = _max(self.prefill_device_bytes, snap.device_bytes)

    def decode_step(self, host_rss_bytes: int, device_bytes: int | None) -> None:
        self.decode_peak_host_rss_bytes = _max(self.decode_peak_host_rss_bytes, host_rss_bytes)
        self.decode_peak_device_bytes = _max(self.decode_peak_device_bytes, device_bytes)

    @property
    def device_peak_bytes(self) -> int | None:
        return _max(self.prefill_device_bytes, self.decode_peak_device_bytes)

    def row_fields(self) -> dict[str, Any]:
        """The result row's per-stage memory columns: every figure but the used fractions."""
        return {name: value for name, value in asdict(self).items() if not name.endswith("used_fraction")}
