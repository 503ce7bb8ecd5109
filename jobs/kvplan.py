"""Which KV cache rung a task should start on, and where a tiered rung keeps each layer.

`plan_rungs`: the rungs to try in order (a later OOM moves on; none left means a shorter context).
`plan_placement`: the full-attention layers a tiered rung keeps on the device (docs/kv-cache.md, "Placement").
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.config import ConfigError
from jobs.rungs import RUNGS, STRATEGIES, TierName


@dataclass(frozen=True)
class KVShape:
    """What the KV size of a model depends on, per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: None for full attention, else the most tokens it keeps (a sliding window; 0 for a
    layer with no KV of its own). Empty: every layer is full attention."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVShape.{name} must be positive, got {getattr(self, name)}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"KVShape.layer_windows needs one entry per layer ({self.num_layers}), "
                             f"got {len(self.layer_windows)}")

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """The layers whose KV grows with the document: the ones placement decides about."""
        windows = self.layer_windows or (None,) * self.num_layers
        return tuple(i for i, window in enumerate(windows) if window is None)

    def layer_token_bytes(self, batch: int = 1) -> int:
        """Keys and values of one token of one layer, every batch row."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes * batch


def kv_bytes(shape: KVShape, tokens: int, batch: int = 1) -> int:
    """Keys and values of every layer for `tokens` tokens of `batch` sequences."""
    if tokens < 0 or batch <= 0:
        raise ValueError(f"kv_bytes needs tokens >= 0 and batch > 0, got tokens={tokens}, batch={batch}")
    return shape.num_layers * shape.layer_token_bytes(batch) * tokens


CHARS_PER_TOKEN = 3
"""Rough characters per token, to size a task's KV cache before it is tokenised (on the high side)."""
PROMPT_TOKENS = 64
"""Room for the instruction and chat template around the document."""


def check_strategy(name: str) -> None:
    """A clear error for a cache strategy this tool does not know (`auto` is not a rung)."""
    if name not in STRATEGIES:
        raise ConfigError(f"cache.strategy: unknown cache strategy {name!r}; choose from {sorted(STRATEGIES)}")


def plan_rungs(
    ladder: list[str], kv_bytes: int, device_budget: int, host_budget: int, device_is_cpu: bool
) -> list[str]:
    """The rungs to try, in order: from the first that fits the budgets onwards. On a CPU device the host
    RAM is the device itself, so host-backed rungs are left out."""
    usable = [r for r in ladder if not (device_is_cpu and RUNGS[r].home == "host")]
    for i, rung in enumerate(usable):
        if RUNGS[rung].fits(kv_bytes, device_budget, host_budget):
            return usable[i:]
    return []


@dataclass(frozen=True)
class Placement:
    """Where a tiered cache keeps each full-attention layer: on the device for good (`resident`,
    never moved), or streamed to the device at its turn from host RAM (`host`) or block files
    (`disk`). Sliding-window layers are not listed: they are bounded and always stay on the device."""

    resident_layers: tuple[int, ...]
    host_layers: tuple[int, ...]
    disk_layers: tuple[int, ...]
    layer_token_bytes: int
    """One token of one layer (every batch row): what a streamed layer moves per cached token."""
    tokens: int
    """The document length planned for (prompt + new tokens): resident layers reserve room for it."""
    windowed_layers: int = 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.resident_layers + self.host_layers + self.disk_layers))

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.host_layers + self.disk_layers))

    @property
    def streamed_share(self) -> float:
        """Share of the full-attention KV a decode step moves (0 when every layer is resident)."""
        full = len(self.full_attention_layers)
        return len(self.streamed_layers) / full if full else 0.0

    def moved_per_decode_step(self, cached_tokens: int) -> int:
        """Bytes a decode step moves when the cache holds `cached_tokens` tokens before it: each
        streamed layer's old tokens come in and its new one goes out; resident layers move nothing."""
        return len(self.streamed_layers) * (cached_tokens + 1) * self.layer_token_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory the plan holds at full length: resident layers and the streaming working set."""
        working_set = min(len(self.streamed_layers), 2)
        return (len(self.resident_layers) + working_set) * self.tokens * self.layer_token_bytes

    def describe(self) -> str:
        """One line for the result row, e.g. "resident 15/30 layers, host 15"."""
        parts = [f"resident {len(self.resident_layers)}/{len(self.full_attention_layers)} layers"]
        parts += [f"{tier} {len(layers)}" for tier, layers in (("host", self.host_layers), ("disk", self.disk_layers))
                  if layers]
        if self.windowed_layers:
            parts.append(f"{self.windowed_layers} sliding-window resident")
        return ", ".join(parts)


def device_kv_bytes(shape: KVShape, rung: str, tokens: int, placement: Placement | None) -> int:
    """Device memory one sequence's KV takes at its full length (`tokens`) on `rung`: what a worker's
    batch admission adds up against the device budget."""
    if RUNGS[rung].home == "device":
        return kv_bytes(shape, tokens)
    if placement is not None:
        return placement.device_bytes
    return min(shape.num_layers, 2) * tokens * shape.layer_token_bytes()  # the layer computing, the next


def host_kv_bytes(shape: KVShape, rung: str, tokens: int, placement: Placement | None, block_tokens: int) -> int:
    """Host RAM one sequence's KV takes at its full length (`tokens`) on `rung`, as the worker's host
    meter counts it: whole blocks of each layer kept in RAM, the unfilled tail block of each layer
    streamed from disk. What batch admission adds up against the host budget."""
    home, tier = RUNGS[rung].home, RUNGS[rung].tier
    if tier is None:
        return kv_bytes(shape, tokens) if home == "host" else 0
    streamed = placement.streamed_layers if placement else shape.full_attention_layers
    if placement is not None:
        in_ram = len(placement.host_layers)
    else:
        in_ram = len(streamed) if tier == "host" else 0
    block = block_tokens * shape.layer_token_bytes()
    return in_ram * -(-tokens // block_tokens) * block + (len(streamed) - in_ram) * block


def _spread(layers: tuple[int, ...], k: int) -> tuple[int, ...]:
    """`k` of `layers`, evenly spaced."""
    n = len(layers)
    return tuple(layers[(2 * i + 1) * n // (2 * k)] for i in range(k)) if k else ()


def plan_placement(
    shape: KVShape,
    tokens: int,
    tier: TierName,
    device_budget: int,
    host_budget: int,
    block_tokens: int,
    batch: int = 1,
    device_is_cpu: bool = False,
) -> Placement:
    """Split the full-attention layers of a `tokens`-long document (prompt + new tokens) between
    the device and the tier (docs/kv-cache.md, "Placement").

    When not even the streaming working set fits, the cache's budget guard raises the OOM that moves the
    task on. Resident layers are spread among the streamed ones, so each prefetch hides behind the compute
    of several layers.
    """
    full = shape.full_attention_layers
    token_bytes = shape.layer_token_bytes(batch)
    windowed = sum(min(tokens, w) for w in shape.layer_windows if w is not None) * token_bytes

    def device_need(resident: int) -> int:
        return (resident + min(len(full) - resident, 2)) * tokens * token_bytes + windowed

    resident = next((n for n in range(len(full), 0, -1) if device_need(n) <= device_budget), 0)
    kept = _spread(full, resident)
    streamed = tuple(i for i in full if i not in kept)
    if tier == "host":
        in_ram = len(streamed)
    elif device_is_cpu:
        in_ram = 0
    else:
        tail = block_tokens * token_bytes  # every streamed layer's unfilled block, in RAM on any tier
        beyond_tail = -(-tokens // block_tokens) * tail - tail  # a host layer's sealed blocks
        spare = host_budget - len(streamed) * tail
        in_ram = len(streamed) if beyond_tail == 0 else max(0, min(len(streamed), spare // beyond_tail))
    host = _spread(streamed, in_ram)
    return Placement(
        resident_layers=kept,
        host_layers=host,
        disk_layers=tuple(i for i in streamed if i not in host),
        layer_token_bytes=token_bytes,
        tokens=tokens,
        windowed_layers=sum(1 for w in shape.layer_windows if w),
    )
