"""How many sequences a worker lets decode together: lowered by a memory error, grown back when calm.

Memory is often short only for a while, so a lowered limit doubles back after `GROW_BACK_STEPS` calm
steps (docs/batching.md); each memory error doubles that wait, so a worker really short settles at what fits.
"""

from __future__ import annotations

GROW_BACK_STEPS = 64
"""Decode steps without a memory error before a lowered limit doubles, after the first memory error."""
MAX_GROW_BACK_STEPS = 4096
"""The longest that wait gets, however many memory errors there were."""


class BatchLimit:
    """The current limit on sequences in one decode batch, between 1 and `configured`."""

    def __init__(self, configured: int, grow_back_steps: int = GROW_BACK_STEPS) -> None:
        self.configured = configured
        self.current = configured
        self.grow_back_steps = grow_back_steps
        self.memory_errors = 0
        self._calm_steps = 0

    @property
    def wait_steps(self) -> int:
        """Calm decode steps before the next doubling: `grow_back_steps` after the first memory error,
        twice as many after each further one, at most `MAX_GROW_BACK_STEPS`."""
        doublings = min(max(self.memory_errors - 1, 0), 32)
        return min(self.grow_back_steps << doublings, max(MAX_GROW_BACK_STEPS, self.grow_back_steps))

    def lower_to(self, limit: int) -> None:
        """A memory error: at most `limit` sequences (at least 1) until the limit grows back."""
        self.memory_errors += 1
        self.current = max(1, min(limit, self.configured))
        self._calm_steps = 0

    def step(self) -> None:
        """One decode step ran without a memory error: the limit may double back."""
        if self.current >= self.configured:
            return
        self._calm_steps += 1
        if self._calm_steps >= self.wait_steps:
            self.current = min(self.current * 2, self.configured)
            self._calm_steps = 0
