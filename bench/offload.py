"""KV offload cost on SmolLM2-135M: every cache strategy side by side on the same real text.

For each context length (GPL-3 text, repeated) and strategy it runs one greedy generate() the way
a worker does (prefill in chunks, then decode) and reports prefill time, decode tokens/s and its
ratio to `dynamic`, resident KV peak, bytes moved per decode step (vs one full KV; counted by the
cache's copies, not planned), the time one read pass over every offloaded layer takes with no
compute (what prefetch must hide), the compression ratio, and whether the tokens match `dynamic`.
The disk tier runs twice: warm (its block files stay in the page cache, as on a machine with RAM to
spare) and cold (each block is dropped from the page cache after it is written and after every read,
with posix_fadvise/madvise on the task's own files, so every decode step reads its KV from the
device, as when the cache outgrows RAM); a second table sets cold against warm, with the bytes
the process really read from the device per decode step (/proc/self/io). Then the codec alone on
the real KV: shuffled zstd vs plain zstd, ratio and MB/s.

Other sections (`--sections`): placement (a decode step moves only the KV that does not fit),
prefill (chunked against layer-major into the disk tier), resident (`dynamic`'s in-place layer against
transformers' DynamicCache); what each measures is said where it is defined below.

Run: python bench/offload.py [--sections strategies,...] [--device cpu|cuda] [--contexts 2048,4096,8192]
     [--new-tokens 32]
"""

from __future__ import annotations

import os

# On a CPU shared with other work, OpenMP threads that spin at barriers stall whenever another
# thread (here: the cache's IO thread) takes their core; sleeping waits keep every strategy sane.
# Read by torch's OpenMP runtime when it loads, so set before importing torch (override from the shell).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import math
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from jobs.config import CacheConfig, ModelConfig, PrefillMode, SummarizeConfig
from jobs.kvplan import KVShape, Placement, kv_bytes, plan_placement
from jobs.rungs import RUNGS
from runner.engine.generation import Generation, generate_once
from runner.engine.kvcache import TieredCache, build_cache, kv_shape
from runner.engine.kvcache.resident import GrowingLayer, allocated_bytes
from runner.engine.model_loader import LoadedModel, load_model
from storage.kvblocks import BlockCodec, KVBlockError, KVBlockStore

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

# -- placement ---------------------------------------------------------------------------------------

# Budget-proportional placement on SmolLM2-135M: a decode step moves only the KV that does not fit.
#
# At the largest of --contexts, side by side in one run: everything resident (`dynamic`), everything
# streamed (a tiered cache without a placement), and device budgets of 25 %, 50 % and 75 % of the
# cache planned by `jobs.kvplan.plan_placement`, on tiered-host and tiered-disk. For each: bytes
# moved per decode step as planned (the plan's overflow) and as measured (what the cache's copies
# wrote, added up at the copy sites in runner/engine/kvcache: tier reads into the layer's buffers,
# new tokens into the RAM tail) side by side, their ratio, decode tokens/s and its ratio to
# dynamic's, resident KV peak against the budget, and whether the tokens are dynamic's. Registered
# in bench/offload.py as the `placement` section:
#
#     python bench/offload.py --sections placement --threads 1 --new-tokens 16

SHARES = (0.25, 0.5, 0.75)
"""Device budgets, as shares of the whole cache (prompt + new tokens)."""


@dataclass(frozen=True)
class Case:
    strategy: str
    budget_label: str
    budget: int | None
    placement: Placement | None


def _cases(shape: KVShape, tokens: int, block_tokens: int, device_is_cpu: bool) -> list[Case]:
    full = kv_bytes(shape, tokens)
    cases = [Case("dynamic", "all resident", None, None)]
    for strategy, tier in ((r.name, r.tier) for r in RUNGS.values() if r.tier):
        cases.append(Case(strategy, "all streamed", None, None))
        for share in SHARES:
            budget = int(full * share)
            # no host RAM to spare on the disk tier, so its streamed layers are read from files
            host_budget = full if tier == "host" else 0
            placement = plan_placement(shape, tokens, tier, budget, host_budget, block_tokens,
                                       device_is_cpu=device_is_cpu)
            cases.append(Case(strategy, f"{share:.0%} of KV", budget, placement))
    return cases


def placement_section(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Bytes moved per decode step, measured beside planned, speed, resident peak, identity."""

    shape = kv_shape(loaded.model.config, loaded.dtype)
    window = loaded.model.config.max_position_embeddings
    context = max(int(c) for c in args.contexts.split(",")) if args.contexts else 4096
    prompt = real_prompt(loaded, min(context, window - args.new_tokens))
    cases = _cases(shape, len(prompt) + args.new_tokens, args.block_tokens, loaded.device.type == "cpu")
    end_kv = kv_bytes(shape, len(prompt) + args.new_tokens - 1)  # the last token is never cached
    best = {}
    with tempfile.TemporaryDirectory(dir=args.offload_root, prefix="kvbench-") as scratch:
        for strategy in ("dynamic", *(r.name for r in RUNGS.values() if r.tier)):  # warm-up: first-call allocations and kernel choices
            run_one(loaded, strategy, real_prompt(loaded, 256), args, Path(scratch))
        for attempt in range(args.repeats):  # round robin, so a busy moment hits every case alike
            for i, case in enumerate(cases):
                run = run_one(loaded, case.strategy, prompt, args, Path(scratch), case.budget, case.placement)
                if i not in best or run.decode_step_s < best[i].decode_step_s:
                    best[i] = run
                print(f"  {case.strategy}, {case.budget_label}, round {attempt + 1}: "
                      f"{1 / run.decode_step_s:.2f} tok/s", flush=True)

    dynamic = best[0]
    print(f"\n{len(prompt)}-token prompt + {args.new_tokens} new tokens: KV {end_kv / MiB:.1f} MiB at the end\n")
    print(f"{'strategy':<12} {'budget':<12} {'placement':<31} {'tok/s':>6} {'x dyn':>5} {'resident MiB':>12} "
          f"{'budget MiB':>10} {'streamed':>8} {'planned MiB/step':>16} {'measured MiB/step':>17} "
          f"{'measured/planned':>16} {'same':>5}")
    for i, case in enumerate(cases):
        run = best[i]
        measured = run.stats.get("bytes_moved_per_decode_step")
        planned = _planned_per_step(case, shape, len(prompt), len(run.new_tokens) - 1)
        streamed = case.placement.streamed_share if case.placement else (0.0 if case.strategy == "dynamic" else 1.0)
        describe = case.placement.describe() if case.placement else case.budget_label
        print(f"{case.strategy:<12} {case.budget_label:<12} {describe:<31} {1 / run.decode_step_s:>6.2f} "
              f"{dynamic.decode_step_s / run.decode_step_s:>5.2f} "
              f"{run.stats['kv_resident_peak_bytes'] / MiB:>12.1f} {fmt(case.budget and case.budget / MiB, 10, '.1f')} "
              f"{streamed:>8.2f} {planned / MiB:>16.2f} {fmt(measured / MiB if measured is not None else None, 17, '.2f')} "
              f"{fmt(measured / planned if measured is not None and planned else None, 16, '.4f')} "
              f"{str(run.new_tokens == dynamic.new_tokens):>5}", flush=True)
    print("\nstreamed: planned share of the full-attention layers streamed. planned: the plan's bytes per decode "
          "step (its streamed layers'\nold tokens in, new token out; Placement.moved_per_decode_step, or the whole "
          "KV when everything is streamed), over the steps\nthis run made. measured: the bytes the cache's copies "
          "wrote for the decode steps (tier -> layer buffers, new token -> RAM\ntail), added up where they happen; "
          "n/a for dynamic, which copies nothing off the device. resident: KV peak on the\ndevice, within the budget.")


def _planned_per_step(case: Case, shape: KVShape, prompt: int, steps: int) -> float:
    """What the plan says a decode step moves, averaged over `steps` steps after a `prompt`-token
    prefill (step s starts with prompt + s - 1 cached tokens)."""
    if case.strategy == "dynamic" or steps <= 0:
        return 0.0
    cached = range(prompt, prompt + steps)
    if case.placement is None:  # everything streamed: each step brings the whole cache in, the new token out
        return sum(kv_bytes(shape, tokens + 1) for tokens in cached) / steps
    return sum(case.placement.moved_per_decode_step(tokens) for tokens in cached) / steps

# -- prefill -----------------------------------------------------------------------------------------

# Prefill into a tiered-disk cache, chunked (token-major, transformers') vs layer-major, side by side.
#
# Chunked prefill reads every layer's earlier chunks back from the disk for each new chunk; layer-major
# (runner/engine/kvcache/layer_major.py) writes each layer once and reads none of it back. Per context and codec, one generate_once() per mode that stops at the first token measures the
# prefill: time to first token, the compute thread's CPU time, disk bytes read and written. The block
# files are flushed and dropped from the page cache after every write, so reads come from the disk: the
# storage-bound case. A second run per mode with --new-tokens checks that both give the same tokens.

MODES: tuple[PrefillMode, ...] = ("chunked", "layer-major")
CODECS = ("none", "zstd")


@dataclass
class Prefill:
    ttft_s: float
    cpu_s: float  # the compute thread's CPU time up to the first token: ttft less waiting (I/O, other processes)
    read: int
    written: int
    read_s: float  # reading and decoding blocks, on the IO thread or the compute thread
    tokens: list[int]


def resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of these files in the page cache (util-linux fincore), None when it cannot tell."""
    if not paths or shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=False)
    return sum(int(line) for line in out.stdout.split()) if out.returncode == 0 else None


def page_cache_check(scratch: Path) -> str:
    """Whether dropping written blocks from the page cache works here, told by writing one block."""
    store = KVBlockStore(scratch / "page-cache-check", BlockCodec("none"))
    try:
        store.drop_page_cache_after_writes()
    except KVBlockError as e:
        store.close()
        return f"page cache NOT dropped ({e}): reads may come from RAM"
    try:
        store.append(0, np.ones(4 * MiB, dtype=np.uint8))
        left = resident_bytes(store.files())
    finally:
        store.close()
    if left is None:
        return "page cache dropped after each block write (posix_fadvise applied; fincore missing, not verified)"
    verdict = "worked: reads come from the disk" if left == 0 else "did NOT work: reads may come from RAM"
    return f"page cache dropped after each block write: a 4 MiB block left {left} bytes cached, {verdict}"


def run(loaded: LoadedModel, prompt: list[int], mode: PrefillMode, codec: str, new_tokens: int,
        args: argparse.Namespace, scratch: Path) -> Prefill:
    cache_cfg = CacheConfig(block_tokens=args.block_tokens, compression=codec, zstd_level=1, prefill=mode)
    settings = SummarizeConfig(max_new_tokens=new_tokens, prefill_chunk_size=args.prefill_chunk)
    offload_dir = scratch / f"{mode}-{codec}-{len(prompt)}-{new_tokens}"
    with build_cache("tiered-disk", loaded.model, cache_cfg, offload_dir, None) as handle:
        store = handle.generate_kwargs["past_key_values"].shared.tier.store
        store.drop_page_cache_after_writes()
        cpu_from = time.thread_time()
        out = generate_once(loaded, prompt, new_tokens, settings, handle.generate_kwargs, cache_cfg.prefill)
        cpu_s = time.thread_time() - cpu_from
        stats = handle.stats()
    return Prefill(out.ttft_s, cpu_s, stats["offload_bytes_read"], stats["offload_bytes_written"], store.read_s,
                   out.tokens)


def prefill_section(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Chunked vs layer-major prefill of a tiered-disk cache: time, bytes read and written, tokens."""
    # bench/ runs as a script, and offload imports this module

    shape = kv_shape(loaded.model.config, loaded.dtype)
    with tempfile.TemporaryDirectory(dir=args.offload_root, prefix="kvbench-prefill-") as tmp:
        scratch = Path(tmp)
        print(page_cache_check(scratch), flush=True)
        for mode in MODES:  # warm-up: first-call allocations and kernel choices
            run(loaded, real_prompt(loaded, 4 * args.prefill_chunk), mode, "none", 1, args, scratch)
        header = (f"{'ctx':>5} {'chunks':>6} {'codec':<5} {'prefill':<11} {'ttft s':>7} {'x chunked':>9} "
                  f"{'cpu s':>6} {'read MiB':>9} {'read s':>7} {'written MiB':>11} {'read/written':>12} "
                  f"{'written/KV':>10} {'same':>5}")
        print("\n" + header)
        for context in (int(c) for c in args.contexts.split(",")):
            window = loaded.model.config.max_position_embeddings
            prompt = real_prompt(loaded, min(context, window - args.new_tokens))
            raw_kv = kv_bytes(shape, len(prompt))
            for codec in CODECS:
                rows: dict[str, Prefill] = {}
                for mode in MODES:
                    first = run(loaded, prompt, mode, codec, 1, args, scratch)
                    full = run(loaded, prompt, mode, codec, args.new_tokens, args, scratch)
                    rows[mode] = dataclasses.replace(first, tokens=full.tokens)
                for mode in MODES:
                    r, base = rows[mode], rows["chunked"]
                    print(f"{len(prompt):>5} {math.ceil(len(prompt) / args.prefill_chunk):>6} {codec:<5} "
                          f"{mode:<11} {r.ttft_s:>7.2f} {base.ttft_s / r.ttft_s:>9.2f} {r.cpu_s:>6.2f} "
                          f"{r.read / MiB:>9.1f} {r.read_s:>7.2f} {r.written / MiB:>11.1f} {r.read / r.written:>12.2f} "
                          f"{r.written / raw_kv:>10.2f} "
                          f"{r.tokens == base.tokens!s:>5}", flush=True)
    print(f"""
ttft: prefill up to the first token, page cache dropped; x chunked: chunked's ttft over this one's.
cpu: the compute thread's CPU time up to the first token (ttft less the time it waited for I/O or for a core).
read s: time spent reading blocks from the disk and decoding them (mostly on the prefetch thread, hidden
behind compute where a core is free; on a GPU with slow storage it is what prefill waits for).
read/written: disk bytes read per byte written up to the first token (layer 0, prefetched for the first
decode step, included); written/KV: bytes written over the prompt's raw KV (the unfilled tail block stays
in RAM; zstd stores less). same: the {args.new_tokens} generated tokens equal chunked's.""")

# -- resident ----------------------------------------------------------------------------------------

# `dynamic` (GrowingLayer: KV written in place, geometric growth) against transformers' plain DynamicCache.
#
# Same model, same prompt, same chunked prefill, run side by side in alternating order each round (the
# fastest round counts): the difference is only the layer that holds the full-attention KV, whose
# concatenation copies the whole prefix at every prefill chunk and decode step. Registered in
# bench/offload.py as the `resident` section:
#
#     python bench/offload.py --sections resident --threads 1 --new-tokens 32

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
            allocated = sum(allocated_bytes(layer) for layer in layers if isinstance(layer, GrowingLayer))
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

# -- strategies, the codec, and the run -----------------------------------------------------------

STRATEGIES = ["dynamic", "tiered-host", "tiered-disk:zstd", "tiered-disk:none"]
COLD = ["tiered-disk:zstd", "tiered-disk:none"]
"""Also run with the page cache kept cold."""


def codec_rows(real_kv: list[tuple[torch.Tensor, torch.Tensor]], block_tokens: int) -> list[str]:
    """The codec alone on the real KV, cut into blocks as the disk tier cuts it."""
    same_width_int = {2: torch.int16, 4: torch.int32}[real_kv[0][0].element_size()]
    blocks = []
    for keys, values in real_kv:
        for tensor in (keys, values):
            bits = tensor.detach().cpu().contiguous().view(same_width_int).numpy()
            for start in range(0, bits.shape[-2] - block_tokens + 1, block_tokens):
                blocks.append(np.ascontiguousarray(bits[:, :, start : start + block_tokens]))
    raw = sum(b.nbytes for b in blocks)
    lines = []
    for label, codec in (("zstd-1 + byte-plane shuffle", BlockCodec("zstd", 1, True)),
                         ("zstd-1 plain", BlockCodec("zstd", 1, False))):
        start = time.perf_counter()
        payloads = [codec.encode(b) for b in blocks]
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        for payload, block in zip(payloads, blocks):
            codec.decode(payload, block.dtype)
        decode_s = time.perf_counter() - start
        ratio = raw / sum(len(p) for p in payloads)
        lines.append(f"{label:<28} ratio {ratio:5.3f}  compress {raw / encode_s / 1e6:7.0f} MB/s  "
                     f"decompress {raw / decode_s / 1e6:7.0f} MB/s  ({len(blocks)} blocks, {raw / MiB:.0f} MiB)")
    return lines


def print_table(runs: list[Run], full_kv: dict[int, int]) -> None:
    header = (f"{'ctx':>5} {'strategy':<21} {'prefill s':>9} {'tok/s':>7} {'x dyn':>6} {'resident MiB':>12} "
              f"{'KV MiB':>7} {'moved/step MiB':>14} {'x KV':>5} {'read-pass ms':>12} {'step/max':>8} "
              f"{'wait ms':>7} {'compr':>6} {'same':>5}")
    if any(r.device_peak_bytes is not None for r in runs):
        header += f" {'dev peak MiB':>12}"
    print(header)
    dynamic = {r.context: r for r in runs if r.strategy == "dynamic"}
    for r in runs:
        base = dynamic[r.context]
        moved = r.stats.get("bytes_moved_per_decode_step")
        wait = r.stats.get("read_wait_per_decode_step_s")
        step_vs_bound = None
        if r.read_pass_s is not None:
            step_vs_bound = r.decode_step_s / max(base.decode_step_s, r.read_pass_s)
        line = (f"{r.context:>5} {label(r):<21} {r.prefill_s:>9.2f} {1 / r.decode_step_s:>7.2f} "
                f"{base.decode_step_s / r.decode_step_s:>6.2f} "
                f"{fmt(r.stats['kv_resident_peak_bytes'] and r.stats['kv_resident_peak_bytes'] / MiB, 12, '.1f')} "
                f"{full_kv[r.context] / MiB:>7.1f} {fmt(moved and moved / MiB, 14, '.1f')} "
                f"{fmt(moved and moved / full_kv[r.context], 5, '.2f')} "
                f"{fmt(r.read_pass_s and r.read_pass_s * 1e3, 12, '.1f')} {fmt(step_vs_bound, 8, '.2f')} "
                f"{fmt(wait and wait * 1e3, 7, '.1f')} "
                f"{fmt(r.stats['compression_ratio'], 6, '.3f')} {str(r.new_tokens == base.new_tokens):>5}")
        if r.device_peak_bytes is not None:
            line += f" {r.device_peak_bytes / MiB:>12.1f}"
        print(line, flush=True)


def label(run: Run) -> str:
    return run.strategy + (" cold" if run.cold else "")


def print_cold_table(runs: list[Run]) -> None:
    """The disk tier cold against warm: decode speed, and what a decode step really read."""
    warm = {r.strategy: r for r in runs if not r.cold}
    print(f"{'ctx':>5} {'codec':<5} {'warm tok/s':>10} {'cold tok/s':>10} {'cold/warm':>9} {'wait ms w/c':>13} "
          f"{'read-pass ms w/c':>17} {'device read MiB/step w/c':>25} {'block MiB/step':>14}")
    for cold in (r for r in runs if r.cold):
        w = warm[cold.strategy]
        waits = [r.stats.get("read_wait_per_decode_step_s") for r in (w, cold)]
        device = [r.decode_io and r.decode_io["read_bytes"] / MiB for r in (w, cold)]
        block = cold.decode_io and cold.decode_io["block_bytes_read"] / MiB
        print(f"{cold.context:>5} {cold.strategy.partition(':')[2]:<5} {1 / w.decode_step_s:>10.2f} "
              f"{1 / cold.decode_step_s:>10.2f} {w.decode_step_s / cold.decode_step_s:>9.2f} "
              f"{fmt(waits[0] and waits[0] * 1e3, 6, '.1f')} {fmt(waits[1] and waits[1] * 1e3, 6, '.1f')} "
              f"{fmt(w.read_pass_s and w.read_pass_s * 1e3, 8, '.1f')} "
              f"{fmt(cold.read_pass_s and cold.read_pass_s * 1e3, 8, '.1f')} "
              f"{fmt(device[0], 12, '.2f')} {fmt(device[1], 12, '.2f')} {fmt(block, 14, '.2f')}", flush=True)


def strategies_section(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Every strategy at every context: decode speed, resident peak, traffic, identity; then the codec."""
    strategies = STRATEGIES + (["offloaded"] if loaded.device.type == "cuda" else [])
    shape = kv_shape(loaded.model.config, loaded.dtype)
    runs: list[Run] = []
    full_kv: dict[int, int] = {}
    with tempfile.TemporaryDirectory(dir=args.offload_root, prefix="kvbench-") as scratch:
        for strategy in strategies:  # warm-up: first-call allocations and kernel choices are not the cache's cost
            run_one(loaded, strategy, real_prompt(loaded, 256), args, Path(scratch))
        for context in (int(c) for c in args.contexts.split(",")):
            # the whole sequence stays within the model's window (8192 for SmolLM2)
            window = loaded.model.config.max_position_embeddings
            prompt = real_prompt(loaded, min(context, window - args.new_tokens))
            full_kv[len(prompt)] = kv_bytes(shape, len(prompt) + args.new_tokens - 1)
            cases = [(strategy, False) for strategy in strategies] + [(strategy, True) for strategy in COLD]
            best: dict[tuple[str, bool], Run] = {}
            for attempt in range(args.repeats):  # round robin, so a busy moment hits every strategy alike
                for case in cases:
                    run = run_one(loaded, case[0], prompt, args, Path(scratch), cold=case[1])
                    if case not in best or run.decode_step_s < best[case].decode_step_s:
                        best[case] = run
                    print(f"  {context} tokens, {label(run)}, round {attempt + 1}: "
                          f"{1 / run.decode_step_s:.2f} tok/s", flush=True)
            runs += [best[c] for c in cases]
            print()
            print_table([best[c] for c in cases], full_kv)
            print()
            print_cold_table([best[c] for c in cases if c[0] in COLD])
            print(flush=True)
    print("x dyn: decode tokens/s over dynamic's. moved/step: device<->host bytes per decode step, added up by the "
          "cache's copies (x KV: over\none full KV). step/max: decode step over max(dynamic's compute-only step, "
          "read-pass), 1.0 = I/O fully hidden.\nwait: per decode step, time the compute thread waited for a layer "
          "(I/O not hidden by prefetch). cold: block files dropped from\nthe page cache after every write and read.\n"
          "w/c: warm / cold. device read: bytes this process fetched from the storage device per decode step "
          "(/proc/self/io read_bytes;\n0 when the page cache serves every read). block: bytes the block store's "
          "reads returned per decode step (compressed size for zstd).\n")
    real_kv = next(r.real_kv for r in reversed(runs) if r.real_kv is not None)
    print(f"codec on the real {loaded.dtype} KV of the {runs[-1].context}-token run:")
    for line in codec_rows(real_kv, args.block_tokens):
        print("  " + line)


SECTIONS = {"strategies": strategies_section}
SECTIONS["prefill"] = prefill_section
SECTIONS["placement"] = placement_section
SECTIONS["resident"] = resident_section
"""Each section takes the loaded model and the parsed arguments and prints its own table."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {list(SECTIONS)}")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype; the KV has the same one")
    parser.add_argument("--contexts", default="2048,4096,8192")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="rounds per context; the fastest decode counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--offload-root", type=Path, default=None, help="fast local disk for the disk tier")
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", dtype=args.dtype, device=args.device))
    print(f"SmolLM2-135M on {loaded.device} ({loaded.dtype}), {torch.get_num_threads()} threads "
          f"(OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}); "
          f"{args.new_tokens} new tokens, blocks of {args.block_tokens}, prefill chunks of {args.prefill_chunk}")
    for section in args.sections.split(","):
        print(f"\n## {section}\n", flush=True)
        SECTIONS[section](loaded, args)


if __name__ == "__main__":
    main()
