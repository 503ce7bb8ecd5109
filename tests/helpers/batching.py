"""The worker's BatchEngine on tiny random models, and "alone": plain `generate()` one prompt at a time.

A batched sequence must give exactly its tokens alone, so every batching test compares with
`tokens_alone`, cut where the loop stop would have ended it (random models loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, PreTrainedModel

from jobs.config import CacheConfig, LoopStopConfig
from jobs.kvplan import kv_bytes
from jobs.stopping import loop_stopped
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.kvcache import CacheHandle, ResidentMeter, build_cache, kv_shape
from runner.engine.kvcache.pool import KVPool
from runner.engine.model_loader import LoadedModel
from runner.engine.probes import StageMemory

LENGTHS = [37, 20, 51, 9, 44]  # mixed lengths, so rows of a step attend to different lengths
NEW = [12, 20, 7, 16, 10]  # and finish at different steps, so rows leave and others join
BIG = 1 << 40
PLAIN = {"generation": {}, "no_repeat_summary_ngram": 0}
"""SummarizeConfig's fields for plain greedy decoding, as `model.generate()` with no settings decodes."""


def as_loaded_model(model: PreTrainedModel, tokenizer) -> LoadedModel:
    """A random model dressed as the worker's loaded model (CPU, fp32)."""
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny", device=torch.device("cpu"),
                       dtype=torch.float32, load_s=0.0)


def tokens_alone(model: PreTrainedModel, prompt: list[int], new: int, rule: LoopStopConfig | None = None) -> list[int]:
    """generate()'s tokens, cut where the loop stop (the default one unless `rule`) would have ended
    them (random models loop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             past_key_values=DynamicCache(config=model.config))
    return loop_stopped(out[0, len(prompt):].tolist(), rule or LoopStopConfig())[0]


def run_batch(engine: BatchEngine, model: PreTrainedModel, strategy: str | list[str], tmp_path: Path,
              prompts: list[list[int]], new: list[int], pool: ResidentMeter | None = None,
              kv_pool: KVPool | None = None, expected: bool | None = None,
              made: dict[int, object] | None = None) -> list:
    """Submits every prompt at once, sequence i on `strategy` (or `strategy[i]`) with its own cache (a
    `dynamic` one a slot of `kv_pool` if given), and returns their generations. `expected` (default: no
    device `pool`) tells `dynamic` the sequence's length up front; `made[i]`, when given, is set to
    sequence i's cache."""
    cfg = CacheConfig(block_tokens=8)
    strategies = [strategy] * len(prompts) if isinstance(strategy, str) else strategy
    sized = pool is None if expected is None else expected

    def make(i: int, tokens: int) -> CacheHandle:
        handle = build_cache(strategies[i], model, cfg, tmp_path / f"seq-{i}", None, None,
                             expected_tokens=tokens if sized else None, device_meter=pool, kv_pool=kv_pool)
        if made is not None:
            made[i] = handle.cache
        return handle

    def request(i: int) -> PassRequest:
        tokens = len(prompts[i]) + new[i]
        return PassRequest(
            prompts[i], new[i],
            make_cache=lambda: make(i, tokens),
            device_bytes=kv_bytes(kv_shape(model.config), tokens), memory=StageMemory(),
        )

    futures = [engine.submit(request(i)) for i in range(len(prompts))]
    return [f.result(timeout=300).generation for f in futures]


def cpu_kv_pool(model: PreTrainedModel, budget: int | None = None) -> KVPool:
    """The worker's pooled KV (batch.attention: pooled) for `model` on the CPU, metered against `budget`."""
    meter = ResidentMeter(budget, "the batch's resident device", "cache.device_kv_budget_bytes")
    return KVPool.for_model(model.config, torch.float32, torch.device("cpu"), meter)


def dynamic_request(model: PreTrainedModel, prompt: list[int], new: int, device_bytes: int | None = 0) -> PassRequest:
    """A pass on a plain `dynamic` cache."""
    return PassRequest(prompt, new, make_cache=lambda: build_cache("dynamic", model, CacheConfig(), None, None),
                       device_bytes=device_bytes)


class AttentionKeys(TorchDispatchMode):
    """The key shape of every SDPA kernel dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if "scaled_dot_product" in func.overloadpacket.__name__:
            self.keys.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))
