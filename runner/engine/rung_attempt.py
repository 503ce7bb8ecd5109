"""One try of one task on one cache rung: what the summarizer calls as its `generate`.

The worker's ladder makes one `RungAttempt` per rung it tries. The attempt turns each prompt the
summarizer hands it into a pass for the worker's engine, with its cache recipe (numbered pass
folders in the task's scratch dir on a disk rung), waits for every pass it handed over, adds up
their cache figures, and raises the first pass's error only once all have ended (so no pass still
writes into a scratch dir that is going away). A pass that an earlier attempt finished is taken from
the task's `PassBook` instead of being run; every pass that ends is kept there the moment it ends.
A fault a test injected for this task and rung strikes after the passes, mid-task, with the scratch
dir in place.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jobs.faults import FaultKind
from jobs.kvplan import Placement
from jobs.outcome import CacheStats, DecodeSteps, add_steps, no_steps
from runner.engine.batch_engine import BatchEngine, PassRequest, PassResult, TaskClock
from runner.engine.cache_recipe import CacheKit
from runner.engine.generation import Generation
from runner.engine.pass_book import PassBook
from runner.engine.probes import StageMemory

PASSES_COLLECTED_WAIT_S = 10.0
"""How long an injected crash or hang waits for the coordinator to collect the passes it follows (a
question of the coordinator's is open while a task runs; none comes for a run outside a job)."""


@dataclass
class CacheTotals:
    """Cache figures over all generate passes of one task, and their decode row-steps by path."""

    kv_bytes: int = 0
    kv_resident_peak_bytes: int = 0
    offload_bytes_written: int = 0
    offload_bytes_read: int = 0
    _raw: int = 0
    _stored: int = 0
    placement: Placement | None = None  # the pass that streamed the most layers
    decode_steps: DecodeSteps = field(default_factory=no_steps)

    def add_placement(self, placement: Placement | None) -> None:
        if placement is not None and (
            self.placement is None or len(placement.streamed_layers) > len(self.placement.streamed_layers)
        ):
            self.placement = placement

    def add(self, stats: CacheStats) -> None:
        self.kv_bytes = max(self.kv_bytes, stats.get("kv_bytes") or 0)
        self.kv_resident_peak_bytes = max(
            self.kv_resident_peak_bytes, stats.get("kv_resident_peak_bytes") or 0
        )
        self.offload_bytes_written += stats.get("offload_bytes_written") or 0
        self.offload_bytes_read += stats.get("offload_bytes_read") or 0
        ratio = stats.get("compression_ratio")
        written = stats.get("offload_bytes_written") or 0
        if ratio and written:
            self._stored += written
            self._raw += int(written * ratio)

    @property
    def compression_ratio(self) -> float | None:
        return self._raw / self._stored if self._stored else None


class RungAttempt:
    """One task's passes on one rung, and their cache totals."""

    def __init__(self, rung: str, kit: CacheKit, engine: BatchEngine, memory: StageMemory, clock: TaskClock,
                 offload_dir: Path | None, doc_id: str, fault: FaultKind | None, passes: PassBook | None = None) -> None:
        """`offload_dir`: the task's scratch dir on a rung that offloads to disk; `fault`: what a test
        injected for this task on this rung (jobs.faults), None for a real run; `passes`: the task's
        finished passes, shared by every rung of the attempt (None: none kept before)."""
        self.rung = rung
        self.totals = CacheTotals()
        self._kit = kit
        self._engine = engine
        self._memory = memory
        self._clock = clock
        self._offload_dir = offload_dir
        self._doc_id = doc_id
        self._fault = fault
        self._pass_numbers = itertools.count()
        self._passes = passes if passes is not None else PassBook.empty()
        self._levels = itertools.count()  # each call is one level: the chunks, then each merge round

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, first_index: int = 0) -> list[Generation]:
        """Generate for every prompt, side by side in the worker's batch; their generations in order.
        `first_index`: the first prompt's place in its level (a pass dealt out alone is one of many)."""
        level = next(self._levels)
        generations = [self._passes.find(ids, max_new_tokens) for ids in prompts]
        to_run = [i for i, generation in enumerate(generations) if generation is None]
        if len(to_run) < len(prompts):  # a pass read back is work done: the task's timeout runs from here
            self._clock.start()
        futures = self._engine.submit_all([self._pass(prompts[i], max_new_tokens) for i in to_run])

        def keep(k: int, generation: Generation) -> None:
            self._passes.keep(level, first_index + to_run[k], prompts[to_run[k]], max_new_tokens, generation)

        for i, generation in zip(to_run, self._results(futures, keep)):
            generations[i] = generation
        self._strike_injected_fault()
        return generations

    def _pass(self, prompt_ids: list[int], max_new_tokens: int) -> PassRequest:
        recipe = self._kit.recipe(self.rung, len(prompt_ids) + max_new_tokens, self._pass_dir())
        self.totals.add_placement(recipe.placement)
        return PassRequest(prompt_ids, max_new_tokens, make_cache=recipe, device_bytes=recipe.device_bytes,
                           host_bytes=recipe.host_bytes, fits=recipe.fits, memory=self._memory, clock=self._clock)

    def _pass_dir(self) -> Path | None:
        """Each pass's own folder in the scratch dir, numbered in the order the passes are handed over."""
        number = next(self._pass_numbers)
        return self._offload_dir / f"pass-{number}" if self._offload_dir else None

    def _results(self, futures: list[Future[PassResult]], keep: Callable[[int, Generation], None]) -> list[Generation]:
        """Every pass's generation once all have ended, each kept as it ends; the first pass's error,
        if any, is raised then."""
        index = {future: k for k, future in enumerate(futures)}
        generations: dict[int, Generation] = {}
        errors: dict[int, Exception] = {}
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 - the first one is raised below
                errors[index[future]] = e
                continue
            self.totals.add(result.cache_stats)
            self.totals.decode_steps = add_steps(self.totals.decode_steps, result.decode_steps)
            generations[index[future]] = result.generation
            keep(index[future], result.generation)
        if errors:
            raise errors[min(errors)]
        return [generations[k] for k in range(len(futures))]

    def _strike_injected_fault(self) -> None:
        """Raise what the real failure raises, where it would raise it."""
        if self._fault is None:
            return
        where = f"injected for {self._doc_id} on {self.rung}"
        if self._fault == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory ({where})")
        if self._fault in ("crash", "hang"):  # after the passes were kept, as a real one would find them
            self._passes.wait_collected(PASSES_COLLECTED_WAIT_S)
        if self._fault == "crash":
            os._exit(17)
        if self._fault == "io":
            raise OSError(errno.EIO, f"Input/output error ({where})")
        if self._fault == "hang":
            while True:
                time.sleep(1)
        raise RuntimeError(f"injected error ({where})")
