"""The small integer tensors a decode step builds on the host and hands to the device without stalling.

`torch.tensor(values, device=cuda)` copies from pageable memory and the host waits, several times a step;
on CUDA the values go through a reused pinned buffer per kind of input with `non_blocking=True`
(docs/kv-cache.md, "The pooled decode step", "Step inputs"); elsewhere through `torch.tensor`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_PER_THREAD = threading.local()


class StepInputs:
    """One thread's step inputs for one device: `put` a kind's values, get them as a device tensor.

    Reusing a pinned buffer is safe: each kind has two buffers used in turn, and writing into one
    first waits for the CUDA event its last copy recorded, the use before last, which the device has
    long run in practice. A buffer replaced by a bigger one is dropped: torch's pinned-memory
    allocator does not hand it out again before the copies queued from it have run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._kinds: dict[str, list[tuple[torch.Tensor | None, torch.cuda.Event]]] = {}
        """Each kind's two buffers, each with the event its last copy recorded: the one to use next first."""

    def put(self, kind: str, values: Sequence[int]) -> torch.Tensor:
        """`values` as a 1-D int64 tensor on the device; `kind` names the host buffer it goes through
        (inputs of one step that are alive at once should be of different kinds)."""
        if not self.pinned:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        host, copied = self._host(kind, len(values))
        host.numpy()[:] = values
        out = host.to(self.device, non_blocking=True)
        copied.record(torch.cuda.current_stream(self.device))
        return out

    def host_buffer(self, kind: str) -> torch.Tensor | None:
        """The pinned buffer `kind`'s last `put` went through (None before any, or off CUDA): what a
        test looks at to see that it is pinned and kept."""
        return self._kinds[kind][-1][0] if kind in self._kinds else None

    def _host(self, kind: str, count: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The next of `kind`'s two pinned buffers, its first `count` values, once free; and its event."""
        if kind not in self._kinds:
            self._kinds[kind] = [(None, torch.cuda.Event()), (None, torch.cuda.Event())]
        buffer, copied = self._kinds[kind].pop(0)
        copied.synchronize()  # the copy out of it before (returns at once if none)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(max(count, 2 * (buffer.numel() if buffer is not None else 32)),
                                 dtype=torch.long, pin_memory=True)
        self._kinds[kind].append((buffer, copied))  # used last: the other one goes next
        return buffer[:count], copied


def step_inputs(device: torch.device) -> StepInputs:
    """This thread's `StepInputs` for `device`: kept across steps so its pinned buffers are reused;
    one per thread, since a buffer is written by the host thread that queues its copy."""
    kept: dict[torch.device, StepInputs] = _PER_THREAD.__dict__.setdefault("inputs", {})
    if device not in kept:
        kept[device] = StepInputs(device)
    return kept[device]
