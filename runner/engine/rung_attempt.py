"""One try of one pass on one cache rung: the worker's ladder makes one per rung it tries.

The attempt hands the pass to the worker's engine with its rung's cache recipe (its own folder in the
pass's scratch dir on a disk rung) and keeps the pass's cache figures. A fault a test injected for the
document and rung (jobs/faults.py) strikes after the pass ran, with its scratch dir in place, before
its row leaves the worker: what the real failure at that moment would cost.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jobs.faults import FaultKind
from jobs.kvplan import Placement
from jobs.outcome import CacheStats, DecodeSteps, no_steps
from runner.engine.batch_engine import BatchEngine, PassRequest, TaskClock
from runner.engine.cache_recipe import CacheKit
from runner.engine.generation import Generation
from runner.engine.probes import StageMemory


@dataclass
class RungAttempt:
    """One pass on one rung, and its cache figures once it ran. `offload_dir`: the pass's scratch dir on
    a rung that offloads to disk; `fault`: what a test injected for this document on this rung
    (jobs.faults), None for a real run."""

    rung: str
    kit: CacheKit
    engine: BatchEngine
    memory: StageMemory
    clock: TaskClock
    offload_dir: Path | None
    doc_id: str
    fault: FaultKind | None
    cache_stats: CacheStats | None = field(default=None, init=False)
    decode_steps: DecodeSteps = field(default_factory=no_steps, init=False)
    placement: Placement | None = field(default=None, init=False)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        """The pass's generation, decoded in the worker's batch; raises what stopped it (or was injected)."""
        recipe = self.kit.recipe(self.rung, len(prompt_ids) + max_new_tokens,
                                 self.offload_dir / "pass" if self.offload_dir else None)
        self.placement = recipe.placement
        request = PassRequest(prompt_ids, max_new_tokens, make_cache=recipe, device_bytes=recipe.device_bytes,
                              host_bytes=recipe.host_bytes, fits=recipe.fits, memory=self.memory, clock=self.clock)
        result = self.engine.submit(request).result()
        self.cache_stats, self.decode_steps = result.cache_stats, result.decode_steps
        self._strike_injected_fault()
        return result.generation

    def _strike_injected_fault(self) -> None:
        """Raise what the real failure raises, where it would raise it."""
        if self.fault is None:
            return
        where = f"injected for {self.doc_id} on {self.rung}"
        if self.fault == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory ({where})")
        if self.fault == "crash":
            os._exit(17)
        if self.fault == "io":
            raise OSError(errno.EIO, f"Input/output error ({where})")
        if self.fault == "hang":
            while True:
                time.sleep(1)
        raise RuntimeError(f"injected error ({where})")
