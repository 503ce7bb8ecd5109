"""Memory at each stage of a task: after model load, after prefill, peak while decoding (device and host).

Operators size batches by where memory goes, so the worker records it per stage instead of one
task-wide peak. The stage boundary comes from the model itself: a forward pre-hook sees prefill
steps (several tokens a call, chunked prefill included) and decode steps (one token a call), so
nothing in the generation loop has to report to it.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def _step_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    if ids is None:
        return kwargs["inputs_embeds"].shape[1]
    return ids.shape[-1]


class StageProbe:
    """Per-task memory figures, taken while the model generates; a context manager around one task.

    On CUDA it resets torch's peak counter when decoding starts (to get the decode peak) and folds
    every reading into `device_peak_bytes`, so the task-wide peak survives the resets.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cuda = device.type == "cuda"
        self.prefill_host_rss_bytes: int | None = None
        self.prefill_device_bytes: int | None = None
        self.decode_peak_host_rss_bytes: int | None = None
        self.decode_peak_device_bytes: int | None = None
        self.device_peak_bytes: int | None = None
        self.host_used_fraction: float | None = None  # highest reading while the task ran
        self.device_used_fraction: float | None = None
        self._decoding = False
        self._prefilling = False  # prefill steps seen since the last decode step
        self._hook: Any = None

    def __enter__(self) -> "StageProbe":
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._hook = self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        if self._decoding:
            self._decode_ended()
        elif self._prefilling:  # a one-token answer: generate() stopped right after prefill
            self._prefill_ended()
        self._decoding = self._prefilling = False
        if self.cuda:
            self.device_peak_bytes = _max(self.device_peak_bytes, torch.cuda.max_memory_allocated(self.device))

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _step_tokens(args, kwargs) > 1:  # a prefill step: a new pass begins, or a prefill chunk
            if self._decoding:
                self._decode_ended()
            self._decoding, self._prefilling = False, True
            return
        if not self._decoding:
            self._decoding, self._prefilling = True, False
            self._prefill_ended()
        rss = psutil.Process().memory_info().rss
        self.decode_peak_host_rss_bytes = int(_max(self.decode_peak_host_rss_bytes, rss))

    def _observe(self, snap: MemorySnapshot) -> None:
        self.host_used_fraction = _max(self.host_used_fraction, snap.host_used_fraction)
        self.device_used_fraction = _max(self.device_used_fraction, snap.device_used_fraction)

    def _prefill_ended(self) -> None:
        snap = memory_snapshot(self.device)
        self._observe(snap)
        self.prefill_host_rss_bytes = int(_max(self.prefill_host_rss_bytes, snap.host_rss_bytes))
        if self.cuda:
            self.prefill_device_bytes = int(_max(self.prefill_device_bytes, snap.device_bytes))
            self.device_peak_bytes = _max(self.device_peak_bytes, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def _decode_ended(self) -> None:
        self._observe(memory_snapshot(self.device))
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            self.decode_peak_device_bytes = int(_max(self.decode_peak_device_bytes, peak))
            self.device_peak_bytes = _max(self.device_peak_bytes, peak)

    def row_fields(self) -> dict[str, Any]:
        """The result row's per-stage memory columns."""
        return {
            "prefill_host_rss_bytes": self.prefill_host_rss_bytes,
            "prefill_device_bytes": self.prefill_device_bytes,
            "decode_peak_host_rss_bytes": self.decode_peak_host_rss_bytes,
            "decode_peak_device_bytes": self.decode_peak_device_bytes,
        }
