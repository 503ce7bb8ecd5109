"""The rungs of the KV-cache ladder: one frozen value per cache strategy, with what the planner and
the worker need to know about it (like transformers' layer flags, not parallel sets of names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TierName = Literal["host", "disk"]
Home = Literal["device", "host", "disk"]


@dataclass(frozen=True)
class Rung:
    """One cache strategy."""

    name: str
    home: Home
    """Where the bulk of the KV lives: the budget it has to fit."""
    tier: TierName | None = None
    """For our tiered caches, the tier their streamed layers come from; None for the others."""
    cuda_only: bool = False
    """transformers' own offloading moves layers between a CUDA device and the host."""

    @property
    def needs_offload_dir(self) -> bool:
        """Its blocks live in the task's own scratch dir, so the worker makes one and checks free space."""
        return self.home == "disk"

    def fits(self, kv_bytes: int, device_budget: int, host_budget: int) -> bool:
        """Whether a task's KV fits the budget this rung draws on; disk space is checked by the worker
        against the offload root before the task starts."""
        budget = {"device": device_budget, "host": host_budget}.get(self.home)
        return budget is None or kv_bytes <= budget


RUNGS: dict[str, Rung] = {
    rung.name: rung
    for rung in (
        Rung("dynamic", "device"),
        Rung("static", "device"),
        Rung("tiered-host", "host", tier="host"),
        Rung("offloaded", "host", cuda_only=True),
        Rung("offloaded_static", "host", cuda_only=True),
        Rung("tiered-disk", "disk", tier="disk"),
    )
}
STRATEGIES = frozenset(RUNGS)
"""Every cache strategy a config may name (`auto` is not a rung: it asks the planner)."""
