"""From `cache.strategy` to what one `generate()` call needs: the cache, its stats, its cleanup.

One `CacheHandle` per attempt on a rung (jobs.kvplan plans the rungs and a tiered rung's placement);
a `torch.OutOfMemoryError`, real or the budget guard's, moves the task to the next rung.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch
from transformers import PreTrainedModel

from jobs.config import CacheConfig, ConfigError
from jobs.kvplan import Placement, check_strategy
from jobs.rungs import RUNGS
from runner.engine.kvcache.budget import ResidentMeter
from runner.engine.kvcache.dynamic import BudgetedDynamicCache
from runner.engine.kvcache.handle import CacheHandle
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.kvcache.tiered import TieredCache

CUDA_SAFETY_MARGIN = 0.10
"""Share of a GPU's memory left for activations and the allocator when the device budget is auto."""
CUDA_MIN_MARGIN_BYTES = 1 << 30
RAM_SHARE = 0.5
"""Share of the currently available RAM a task's KV may take when a budget is auto on the host."""


def ram_left_by_weights(available_before_load: int, weight_bytes: int, available_after_load: int) -> int:
    """The RAM a worker's caches may count on: what was available before the model loaded less its
    weights' real bytes (a quantized model's packed bytes, runner/engine/quantization.py:weight_bytes),
    and never more than what is available after the load (which also loses the load's leftovers)."""
    return max(min(available_before_load - weight_bytes, available_after_load), 0)


def resolve_budgets(cache_cfg: CacheConfig, device: torch.device, node_workers: int = 1,
                    device_workers: int = 1, ram_left: int | None = None) -> tuple[int, int]:
    """(device, host) KV budgets in bytes; `auto` takes this worker's share of what this machine has free:
    `ram_left` (default: the RAM available now) split among the node's `node_workers`, a GPU's free memory
    among the `device_workers` that share it (jobs.node_share)."""
    ram = psutil.virtual_memory().available if ram_left is None else ram_left
    available_ram = int(ram * RAM_SHARE) // max(node_workers, 1)
    host = available_ram if cache_cfg.host_kv_budget_bytes == "auto" else cache_cfg.host_kv_budget_bytes
    if cache_cfg.device_kv_budget_bytes != "auto":
        return cache_cfg.device_kv_budget_bytes, host
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        margin = max(int(total * CUDA_SAFETY_MARGIN), CUDA_MIN_MARGIN_BYTES)
        return max(free - margin, 0) // max(device_workers, 1), host
    return available_ram, host


def build_cache(
    strategy: str,
    model: PreTrainedModel,
    cache_cfg: CacheConfig,
    offload_dir: Path | None,
    device_budget_bytes: int | None,
    host_budget_bytes: int | None = None,
    placement: Placement | None = None,
    expected_tokens: int | None = None,
    device_meter: ResidentMeter | None = None,
    host_meter: ResidentMeter | None = None,
    kv_pool: KVPool | None = None,
) -> CacheHandle:
    """A fresh cache for one generate() call. `offload_dir`: the task's scratch dir (disk tier);
    `placement`: the layers a tiered rung keeps on the device; `expected_tokens` lets `dynamic` allocate
    once; `device_meter`/`host_meter`: the worker's meters every cache of a batch counts against;
    `kv_pool`: where a pooled `dynamic` cache takes its slot."""
    check_strategy(strategy)
    rung = RUNGS[strategy]
    if strategy == "dynamic" and kv_pool is not None:
        return CacheHandle(strategy, PooledCache(kv_pool, expected_tokens))
    if strategy == "dynamic":
        cache = BudgetedDynamicCache(model.config, device_budget_bytes, expected_tokens, device_meter)
        return CacheHandle(strategy, cache)
    if rung.tier is not None:
        if kv_pool is not None:  # an empty pool's device room is the tiered cache's
            kv_pool.give_way()
        return CacheHandle(strategy, TieredCache(
            model.config,
            tier=rung.tier,
            offload_dir=offload_dir,
            block_tokens=cache_cfg.block_tokens,
            compression=cache_cfg.compression,
            zstd_level=cache_cfg.zstd_level,
            shuffle=cache_cfg.shuffle,
            device_budget_bytes=device_budget_bytes,
            host_budget_bytes=host_budget_bytes,
            placement=placement,
            device_meter=device_meter,
            host_meter=host_meter,
            batched_attention=kv_pool is not None,
        ))
    if rung.cuda_only and model.device.type != "cuda":
        raise ConfigError(
            f"cache.strategy {strategy!r} is transformers' own offloading, which needs a CUDA device; "
            f"this model runs on {model.device.type}: use tiered-host or tiered-disk instead"
        )
    # transformers' own `cache_implementation` values: generate() builds that cache itself
    return CacheHandle(strategy, None)
