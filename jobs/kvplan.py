"""Which KV cache rung a task should start on: a size estimate and the budgets, nothing else.

Pure policy: the worker describes the model as a `KVShape`, resolves the budgets to numbers and
asks `plan_rungs` for the rungs to try in order. A later OOM (or the budget guard) moves the task
to the next rung of that list; an empty list means the context has to shrink.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.config import ConfigError

DEVICE_RESIDENT = frozenset({"dynamic", "static"})
"""Keep every layer's KV on the device."""
HOST_BACKED = frozenset({"tiered-host", "offloaded", "offloaded_static"})
"""Keep the KV in host RAM and bring a layer or two to the device at a time."""
DISK_BACKED = frozenset({"tiered-disk"})
"""Keep the KV in the task's offload dir; RAM and device hold only a few blocks and layers."""
CUDA_ONLY = frozenset({"offloaded", "offloaded_static"})
"""transformers' own offloading moves layers between a CUDA device and the host."""
STRATEGIES = DEVICE_RESIDENT | HOST_BACKED | DISK_BACKED


@dataclass(frozen=True)
class KVShape:
    """What the KV size of a model depends on, per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVShape.{name} must be positive, got {getattr(self, name)}")


def kv_bytes(shape: KVShape, tokens: int, batch: int = 1) -> int:
    """Keys and values of every layer for `tokens` tokens of `batch` sequences."""
    if tokens < 0 or batch <= 0:
        raise ValueError(f"kv_bytes needs tokens >= 0 and batch > 0, got tokens={tokens}, batch={batch}")
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes * tokens * batch


def check_strategy(name: str, key: str = "cache.strategy") -> None:
    """A clear error for a cache strategy this tool does not know (`auto` is not a rung)."""
    if name not in STRATEGIES:
        raise ConfigError(f"{key}: unknown cache strategy {name!r}; choose from {sorted(STRATEGIES)}")


def _fits(rung: str, kv: int, device_budget: int, host_budget: int) -> bool:
    if rung in DEVICE_RESIDENT:
        return kv <= device_budget
    if rung in HOST_BACKED:
        return kv <= host_budget
    return True  # disk: the worker checks the offload root's free space before the task starts


def plan_rungs(
    ladder: list[str], kv_bytes: int, device_budget: int, host_budget: int, device_is_cpu: bool
) -> list[str]:
    """The rungs to try, in order: from the first that fits the budgets onwards.

    On a CPU device the host RAM is the device itself, so host-backed rungs (ours and
    transformers' CUDA-only offloading) are left out.
    """
    for rung in ladder:
        check_strategy(rung, "cache.ladder")
    usable = [r for r in ladder if not (device_is_cpu and r in HOST_BACKED)]
    for i, rung in enumerate(usable):
        if _fits(rung, kv_bytes, device_budget, host_budget):
            return usable[i:]
    return []
