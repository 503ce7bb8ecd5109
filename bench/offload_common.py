"""What every section of bench/offload.py shares: the real prompt, one measured generate() run per
cache strategy (warm, or with the disk tier's page cache kept cold), the process's I/O counters over
its decode steps, and number formatting."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from jobs.config import CacheConfig, SummarizeConfig
from jobs.kvplan import Placement
from runner.engine.generation import generate_once
from runner.engine.kvcache import TieredCache, build_cache
from runner.engine.model_loader import LoadedModel
from storage.kvblocks import KVBlockStore

TEXT = Path("/usr/share/common-licenses/GPL-3")
MiB = 1 << 20


@dataclass
class Run:
    context: int
    strategy: str
    prefill_s: float
    decode_step_s: float
    new_tokens: list[int]
    stats: dict[str, Any]
    read_pass_s: float | None
    device_peak_bytes: int | None
    real_kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # dynamic's KV, for the codec measurement
    cold: bool = False  # the disk tier's block files were dropped from the page cache after every write and read
    decode_io: dict[str, float] | None = None  # per decode step: see DecodeIO.per_step


def proc_io() -> dict[str, int]:
    """This process's I/O counters (all threads): rchar = bytes returned by read syscalls (mmap
    reads are not among them), read_bytes = bytes fetched from the storage device (page cache
    misses, mapped pages included)."""
    with open("/proc/self/io") as io:
        return {key: int(value) for key, value in (line.split(": ") for line in io.read().splitlines())}


class DecodeIO:
    """The process's read counters and the block store's, from the first decode step on.

    A forward pre-hook notes them when generate() first runs the model on one new token (prefill
    runs it on chunks, or not at all after layer-major prefill). The prefetch of the first decode
    step's first layer is issued by the prefill and may finish before that; the prefetch issued after
    the last step for a step that never comes is counted instead: one layer each way."""

    def __init__(self, model: torch.nn.Module, store: KVBlockStore | None) -> None:
        self.store = store
        self.start: dict[str, int] | None = None
        self._hook: RemovableHandle = model.register_forward_pre_hook(self._note, with_kwargs=True)

    def __enter__(self) -> "DecodeIO":
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    def _counters(self) -> dict[str, int]:
        counters = proc_io()
        counters["block_bytes_read"] = self.store.bytes_read if self.store is not None else 0
        return counters

    def _note(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.start is None and ids is not None and ids.shape[-1] == 1:
            self.start = self._counters()

    def per_step(self, steps: int) -> dict[str, float] | None:
        """Counter deltas since the first decode step over `steps`; call once the cache has drained."""
        if self.start is None or steps <= 0:
            return None
        end = self._counters()
        return {key: (end[key] - self.start[key]) / steps for key in ("rchar", "read_bytes", "block_bytes_read")}


def real_prompt(loaded: LoadedModel, tokens: int) -> list[int]:
    text = TEXT.read_text(encoding="utf-8")
    ids: list[int] = []
    while len(ids) < tokens:
        ids += loaded.tokenizer(text, add_special_tokens=False).input_ids
    return ids[:tokens]


def run_one(loaded: LoadedModel, strategy: str, prompt: list[int], args: argparse.Namespace, scratch: Path,
            device_budget: int | None = None, placement: Placement | None = None, cold: bool = False) -> Run:
    """One greedy generate() the way a worker runs it; `cold` (tiered-disk only) keeps the block
    files out of the page cache, so every decode step reads its blocks from the device."""
    name, _, compression = strategy.partition(":")
    cache_cfg = CacheConfig(block_tokens=args.block_tokens, compression=compression or "zstd", zstd_level=1)
    settings = SummarizeConfig(max_new_tokens=args.new_tokens, prefill_chunk_size=args.prefill_chunk)
    offload_dir = scratch / f"{name}-{compression}-{len(prompt)}{'-cold' if cold else ''}"
    cuda = loaded.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    with build_cache(name, loaded.model, cache_cfg, offload_dir, device_budget, None, placement,
                     expected_tokens=len(prompt) + args.new_tokens) as handle:
        cache = handle.generate_kwargs.get("past_key_values")
        store = cache.shared.tier.store if isinstance(cache, TieredCache) and name == "tiered-disk" else None
        if cold:
            if store is None:
                raise ValueError(f"a cold page cache is for tiered-disk, not {strategy}")
            store.keep_page_cache_cold()
        with DecodeIO(loaded.model, store) as decode_io:
            out = generate_once(loaded, prompt, args.new_tokens, settings, handle.generate_kwargs)
        device_peak = torch.cuda.max_memory_allocated() - baseline if cuda else None
        stats = handle.stats()  # drains the IO thread: its reads are in the counters
        extra = cache.stats() if cache is not None else {}
        io_per_step = decode_io.per_step(len(out.tokens) - 1)
        stats.update({k: extra.get(k) for k in ("bytes_moved_per_decode_step", "read_wait_per_decode_step_s",
                                                "decode_steps", "host_to_device_bytes")})
        read_pass = cache.time_read_pass() if isinstance(cache, TieredCache) else None
        real_kv = [(layer.keys, layer.values) for layer in cache.layers] if name == "dynamic" else None
    decode_steps = max(len(out.tokens) - 1, 1)
    return Run(len(prompt), strategy, out.ttft_s, out.decode_s / decode_steps, out.tokens, stats, read_pass,
               device_peak, real_kv, cold, io_per_step)


def fmt(value: float | None, width: int, spec: str) -> str:
    return ("n/a" if value is None else format(value, spec)).rjust(width)
