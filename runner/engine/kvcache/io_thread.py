"""The background thread that reads KV ahead of the layer that needs it, and seals blocks.

Jobs run in order, so a read sees the blocks sealed before it; a batched step's read of every row is one
job on its first row's thread, and a seal waits for nothing on another thread, so threads never wait in a
cycle. On CUDA copies go on a side stream and the compute stream waits for their event on the device
(`adopt`), so neither thread waits on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import TypeVar

import torch

T = TypeVar("T")


class IOThread:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-io")

    def submit(self, job: Callable[..., T], *args: object) -> Future[T]:
        return self._pool.submit(self._run, job, *args)

    def run(self, job: Callable[..., T], *args: object) -> T:
        """Run `job` after everything already queued, and wait for it."""
        return self.submit(job, *args).result()

    def _run(self, job: Callable[..., T], *args: object) -> T:
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            return job(*args)

    def adopt(self, filled: torch.cuda.Event | None, *tensors: torch.Tensor) -> None:
        """Order the caller's stream after `filled` (the event a job recorded after filling `tensors`)
        and mark the tensors as used by that stream, so the allocator does not hand their memory
        out again before that stream is done with them. Call on the compute thread."""
        if self._stream is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(filled)  # on CUDA every read records one
        for tensor in tensors:
            tensor.record_stream(stream)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
