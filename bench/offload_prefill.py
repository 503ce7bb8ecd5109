"""Prefill into a tiered-disk cache, chunked (token-major, transformers') vs layer-major, side by side.

Chunked prefill reads every layer's earlier chunks back from the disk for each new chunk; layer-major
(runner/engine/kvcache/layer_major.py) writes each layer once and reads none of it back. Per context and codec, one generate_once() per mode that stops at the first token measures the
prefill: time to first token, the compute thread's CPU time, disk bytes read and written. The block
files are flushed and dropped from the page cache after every write, so reads come from the disk: the
storage-bound case. A second run per mode with --new-tokens checks that both give the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from offload_common import real_prompt  # bench/ is on sys.path as a script

from jobs.config import CacheConfig, PrefillMode, SummarizeConfig
from jobs.kvplan import kv_bytes
from runner.engine.generation import generate_once
from runner.engine.kvcache import build_cache, kv_shape
from runner.engine.model_loader import LoadedModel
from storage.kvblocks import BlockCodec, KVBlockError, KVBlockStore

MiB = 1 << 20
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
