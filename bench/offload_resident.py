"""`dynamic` (GrowingLayer: KV written in place, geometric growth) against transformers' plain DynamicCache.

Same model, same prompt, same chunked prefill, run side by side in alternating order each round (the
fastest round counts): the difference is only the layer that holds the full-attention KV, whose
concatenation copies the whole prefix at every prefill chunk and decode step. Registered in
bench/offload.py as the `resident` section:

    python bench/offload.py --sections resident --threads 1 --new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from offload_common import real_prompt  # bench/ is on sys.path as a script
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from jobs.config import CacheConfig, SummarizeConfig
from jobs.kvplan import kv_bytes
from runner.engine.generation import Generation, generate_once
from runner.engine.kvcache import build_cache, kv_shape
from runner.engine.kvcache.resident import GrowingLayer
from runner.engine.model_loader import LoadedModel

MiB = 1 << 20
VARIANTS = ("DynamicCache", "dynamic")


@dataclass
class Timed:
    generation: Generation
    decode_step_s: float  # the median decode step, wall clock
    decode_cpu_s: float  # the median decode step, CPU time of this process (unmoved by waiting for a core)
    allocated_bytes: int | None  # GrowingLayer capacity, keys and values of all layers


class _StepClock(StoppingCriteria):
    """generate() asks it once per new token: the gaps are the decode steps (the first follows prefill)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.BoolTensor:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    @staticmethod
    def median_step_s(times: list[float]) -> float:
        """The median rather than the mean: a burst of other work on a shared CPU moves it least."""
        return statistics.median(b - a for a, b in zip(times, times[1:]))


def _run(loaded: LoadedModel, variant: str, prompt: list[int], settings: SummarizeConfig) -> Timed:
    clock = _StepClock()
    if variant == "DynamicCache":
        cache = DynamicCache(config=loaded.model.config)
        kwargs = {"past_key_values": cache, "stopping_criteria": StoppingCriteriaList([clock])}
        out = generate_once(loaded, prompt, settings.max_new_tokens, settings, kwargs)
        allocated = None
    else:
        # as a worker builds it: the task's length is known, so the buffers are allocated once
        with build_cache("dynamic", loaded.model, CacheConfig(), None, None,
                         expected_tokens=len(prompt) + settings.max_new_tokens) as handle:
            kwargs = {**handle.generate_kwargs, "stopping_criteria": StoppingCriteriaList([clock])}
            out = generate_once(loaded, prompt, settings.max_new_tokens, settings, kwargs)
            layers = handle.generate_kwargs["past_key_values"].layers
            allocated = sum(layer.capacity_bytes for layer in layers if isinstance(layer, GrowingLayer))
    return Timed(out, clock.median_step_s(clock.wall), clock.median_step_s(clock.cpu), allocated)


def resident_section(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Decode ms/step and prefill s of both, their ratio, and whether the tokens are identical."""

    settings = SummarizeConfig(max_new_tokens=args.new_tokens, prefill_chunk_size=args.prefill_chunk)
    for variant in VARIANTS:  # warm-up: first-call allocations and kernel choices
        _run(loaded, variant, real_prompt(loaded, 256), settings)
    window = loaded.model.config.max_position_embeddings
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = real_prompt(loaded, min(context, window - args.new_tokens))
        runs: dict[str, list[Timed]] = {variant: [] for variant in VARIANTS}
        for attempt in range(args.repeats):
            order = VARIANTS if attempt % 2 == 0 else VARIANTS[::-1]  # neither always runs first
            for variant in order:
                runs[variant].append(_run(loaded, variant, prompt, settings))
                print(f"  {len(prompt)} tokens, {variant}, round {attempt + 1}: "
                      f"{runs[variant][-1].decode_step_s * 1e3:.1f} ms/step", flush=True)
        rows.append((len(prompt), runs["DynamicCache"], runs["dynamic"]))

    shape = kv_shape(loaded.model.config, loaded.dtype)
    print(f"\n{'ctx':>5} {'DynamicCache ms/step':>20} {'dynamic ms/step':>15} {'x faster':>8} "
          f"{'CPU ms/step (DC / dyn)':>22} {'x CPU':>5} {'prefill s (DC / dyn)':>20} {'KV MiB':>7} {'alloc MiB':>9} "
          f"{'same':>5}")
    for context, plain, mine in rows:
        step_plain, step_mine = (min(r.decode_step_s for r in variant_runs) for variant_runs in (plain, mine))
        cpu_plain, cpu_mine = (min(r.decode_cpu_s for r in variant_runs) for variant_runs in (plain, mine))
        prefill = " / ".join(f"{min(r.generation.ttft_s for r in variant_runs):.2f}" for variant_runs in (plain, mine))
        same = all(r.generation.tokens == plain[0].generation.tokens for r in plain + mine)
        kv_mib = kv_bytes(shape, context + len(mine[0].generation.tokens) - 1) / MiB  # the last token is never cached
        print(f"{context:>5} {step_plain * 1e3:>20.1f} {step_mine * 1e3:>15.1f} {step_plain / step_mine:>8.2f} "
              f"{f'{cpu_plain * 1e3:.1f} / {cpu_mine * 1e3:.1f}':>22} {cpu_plain / cpu_mine:>5.2f} {prefill:>20} "
              f"{kv_mib:>7.1f} {(mine[-1].allocated_bytes or 0) / MiB:>9.1f} {str(same):>5}", flush=True)
    print("\nms/step: a run's median decode step, fastest of the rounds; x faster: DynamicCache's over dynamic's.\n"
          "CPU ms/step: the same in this process's CPU time (x CPU: the ratio), steadier on a shared machine.\n"
          "prefill: fastest of the rounds. alloc: GrowingLayer capacity at the end (geometric growth, x1.5),\n"
          "against the KV it holds. same: every run of both produced identical new tokens.")
