"""What every section of bench/offload.py shares: the real prompt, one measured generate() run per
cache strategy, and number formatting."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jobs.config import CacheConfig, SummarizeConfig
from jobs.kvplan import Placement
from runner.engine.generation import generate_once
from runner.engine.kvcache import TieredCache, build_cache
from runner.engine.models import LoadedModel

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


def real_prompt(loaded: LoadedModel, tokens: int) -> list[int]:
    text = TEXT.read_text(encoding="utf-8")
    ids: list[int] = []
    while len(ids) < tokens:
        ids += loaded.tokenizer(text, add_special_tokens=False).input_ids
    return ids[:tokens]


def run_one(loaded: LoadedModel, strategy: str, prompt: list[int], args: argparse.Namespace, scratch: Path,
            device_budget: int | None = None, placement: Placement | None = None) -> Run:
    name, _, compression = strategy.partition(":")
    cache_cfg = CacheConfig(block_tokens=args.block_tokens, compression=compression or "zstd", zstd_level=1)
    settings = SummarizeConfig(max_new_tokens=args.new_tokens, prefill_chunk_size=args.prefill_chunk)
    offload_dir = scratch / f"{name}-{compression}-{len(prompt)}"
    cuda = loaded.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    with build_cache(name, loaded.model, cache_cfg, offload_dir, device_budget, None, placement,
                     expected_tokens=len(prompt) + args.new_tokens) as handle:
        out = generate_once(loaded, prompt, args.new_tokens, settings, handle.generate_kwargs)
        device_peak = torch.cuda.max_memory_allocated() - baseline if cuda else None
        stats = handle.stats()
        cache = handle.generate_kwargs.get("past_key_values")
        extra = cache.stats() if cache is not None else {}
        stats.update({k: extra.get(k) for k in ("bytes_moved_per_decode_step", "read_wait_per_decode_step_s")})
        read_pass = cache.time_read_pass() if isinstance(cache, TieredCache) else None
        real_kv = [(layer.keys, layer.values) for layer in cache.layers] if name == "dynamic" else None
    decode_steps = max(len(out.tokens) - 1, 1)
    return Run(len(prompt), strategy, out.ttft_s, out.decode_s / decode_steps, out.tokens, stats, read_pass,
               device_peak, real_kv)


def fmt(value: float | None, width: int, spec: str) -> str:
    return ("n/a" if value is None else format(value, spec)).rjust(width)
