"""The decode step on a device, side by side in one run (issue 36): bench/device.sh's bench step.

A random Llama of Llama-3-8B's shape in bf16 (small shapes in fp32 on the CPU, a dry run), tokenizer-
free, same-length prompts (8,192 tokens on CUDA). For each width (32, 8, 1 rows, widest first), one
prefill, then `--decode-steps` steps of each way to decode them:

- `static-cache graph`: plain transformers, `StaticCache`, one decode step captured in a
  `torch.cuda.CUDAGraph` and replayed, the tokens left on the device (gpt-fast's way: the fastest a
  transformers user writes); eager on the CPU, where there are no graphs;
- `kvbatch graphed`: kvbatch's static step (runner/engine/static_step.py), replayed per bucket and span,
  the tokens read every step as the worker reads them; `kvbatch graphed, cuDNN off`: the same without
  SDPA's cuDNN backend (CUDA only); `kvbatch static eager`: the static step without graphs;
  `kvbatch pooled eager`: the pooled step as it ran before the static one (`mixed_step`).

Each row: decode tok/s, its share of the memory-bandwidth bound (what a step must read, at the rate
this device reads memory, measured first), x the static-cache graph's, host ms per step (the host's
time to queue a step) and kernels per step (counted by the profiler: CUDA kernels, or aten ops on the
CPU). Then the tokens: each kvbatch row against the same prompts decoded one at a time (pooled alone,
and on the per-row path): 100 % is the contract. Then one long prompt streamed from host RAM
(tiered-host) against transformers' `offloaded`, and against the bound the host link allows (its
pinned copy rate, measured here). The JSON report is rewritten after every row; rows not started by
`--deadline` seconds are skipped and listed.

Run: python bench/device_step.py --device cuda --report device.json
     python bench/device_step.py --device cpu   (a dry run: small shapes)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from throughput import (
    DEVICE_SHAPES,
    _free,
    _sync,
    agreement,
    device_read_gbs,
    offload_rates,
    step_bytes,
    synthetic_llama,
    write_report,
)
from transformers import StaticCache

from jobs.config import SummarizeConfig
from runner.engine.generation import prefill
from runner.engine.kvcache import BudgetedDynamicCache, ResidentMeter
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import LoadedModel
from runner.engine.ragged import decode_step
from runner.engine.static_step import StaticStep, bucket

STARTED = time.monotonic()
"""When this process began: the deadline counts from it (its model and imports included)."""
KVBATCH_WAYS = ("kvbatch graphed", "kvbatch graphed, cuDNN off", "kvbatch static eager", "kvbatch pooled eager")
BASELINE = "static-cache graph"
ALONE_PROMPTS = 4
"""Prompts decoded one at a time for the agreement rows (every width holds the first of them)."""


@dataclass
class Row:
    rows: int
    way: str
    decode_tok_s: float
    host_ms_per_step: float
    kernels_per_step: int
    bound_tok_s: float = 0.0
    of_bound: float = 0.0
    x_baseline: float | None = None
    note: str = ""


def device_order(widths: list[int]) -> list[tuple[int, str]]:
    """The rows, widest first and the baseline before kvbatch's ways at each width: the issue's figures
    (32 rows, graphed against the static-cache graph) come before a deadline can cut the run."""
    return [(width, way) for width in sorted(widths, reverse=True) for way in (BASELINE, *KVBATCH_WAYS)]


def count_kernels(device: torch.device, step: Callable[[], object]) -> int:
    """Kernels one call of `step` launches (aten ops on the CPU), counted by the profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        _sync(device)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset")))
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@contextmanager
def cudnn_sdpa(enabled: bool):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


class PooledPrompts:
    """The prompts prefilled once into a KV pool; `restart` takes every row back to its prompt, so each
    way decodes the same steps from the same state (a step only writes past the prompt)."""

    def __init__(self, loaded: LoadedModel, prompts: list[list[int]], steps: int) -> None:
        self.loaded = loaded
        length = len(prompts[0])
        self.pool = KVPool.for_model(loaded.model.config, loaded.dtype, loaded.device,
                                     ResidentMeter(None, "the bench's device", ""),
                                     planned=(bucket(len(prompts)), length + steps + 8))
        self.caches = [PooledCache(self.pool, length + steps + 8) for _ in prompts]
        settings = SummarizeConfig(prefill_chunk_size=2048)
        self.firsts = [int(prefill(loaded, ids, settings, cache, "auto").argmax()) for ids, cache in
                       zip(prompts, self.caches)]
        self.length = length

    def restart(self) -> None:
        for cache in self.caches:
            cache.length = self.length

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


def decode(device: torch.device, firsts: list[int], steps: int, step: Callable[[list[int]], torch.Tensor],
           restart: Callable[[], None]) -> tuple[float, float, int, list[list[int]]]:
    """tok/s, host ms a step and kernels a step of `step` (last tokens in, [rows] tokens on the device out,
    read every step), and each row's tokens: two untimed steps first (a graph's capture), then `steps`."""
    for _ in range(2):
        step(list(firsts)).tolist()
    restart()
    kernels = count_kernels(device, lambda: step(list(firsts)).tolist())
    restart()
    out = [[t] for t in firsts]
    host = 0.0
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        queued = time.perf_counter()
        tokens = step([row[-1] for row in out])
        host += time.perf_counter() - queued
        for row, token in zip(out, tokens.tolist()):
            row.append(token)
    _sync(device)
    elapsed = time.perf_counter() - started
    return len(firsts) * steps / elapsed, 1000 * host / steps, kernels, out


def kvbatch_way(loaded: LoadedModel, pooled: PooledPrompts, way: str, steps: int
                ) -> tuple[float, float, int, list[list[int]]]:
    caches = pooled.caches
    if way == "kvbatch pooled eager":
        def step(last: list[int]) -> torch.Tensor:
            return decode_step(loaded.model, last, [c.length for c in caches], caches).argmax(-1)
    else:
        static = StaticStep(loaded.model, pooled.pool, graphs=way.startswith("kvbatch graphed"))

        def step(last: list[int]) -> torch.Tensor:
            return static.run(last, caches)[1]
    pooled.restart()
    with cudnn_sdpa(not way.endswith("cuDNN off")) if loaded.device.type == "cuda" else nullcontext():
        result = decode(loaded.device, pooled.firsts, steps, step, pooled.restart)
    pooled.restart()
    return result


def static_cache_graph(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> tuple[float, float, int, list[list[int]], str]:
    """Plain transformers: StaticCache, the prompts prefilled together, one decode step captured in a
    CUDA graph (the ids fed back and the position advanced inside it) and replayed `steps` times, the
    tokens kept on the device until the end. tok/s, host ms a step, kernels a step, tokens, a note."""
    model, device = loaded.model, loaded.device
    length = len(prompts[0])
    cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor(prompts, device=device), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [rows, 1]
        position = torch.tensor([length], device=device)
        kept = [ids.clone()]

        def step() -> None:
            logits = model(input_ids=ids, cache_position=position, past_key_values=cache, use_cache=True).logits
            ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
            position.add_(1)

        run, note = step, "eager (no CUDA graphs on the CPU)"
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up steps are real steps: their tokens count
                    step()
                    kept.append(ids.clone())
            torch.cuda.current_stream(device).wait_stream(side)
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                run, note = graph.replay, "one captured CUDA graph"
            except RuntimeError as e:  # the baseline is reported eager, with why
                run, note = step, f"eager: capture failed: {str(e)[:200]}"
                torch.cuda.synchronize(device)
        kernels = count_kernels(device, run)
        kept.append(ids.clone())
        host = 0.0
        _sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            queued = time.perf_counter()
            run()
            kept.append(ids.clone())
            host += time.perf_counter() - queued
        _sync(device)
        elapsed = time.perf_counter() - started
    tokens = torch.cat(kept, dim=1).tolist()
    return len(prompts) * steps / elapsed, 1000 * host / steps, kernels, tokens, note


def alone_tokens(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> dict[str, list[list[int]]]:
    """The first prompts decoded one at a time, pooled (a pool of one) and on the per-row path."""
    got: dict[str, list[list[int]]] = {"pooled alone": [], "per-row alone": []}
    for ids in prompts[:ALONE_PROMPTS]:
        pooled = PooledPrompts(loaded, [ids], steps)
        got["pooled alone"].append(kvbatch_way(loaded, pooled, "kvbatch static eager", steps)[3][0])
        pooled.close()
        cache = BudgetedDynamicCache(loaded.model.config, None, len(ids) + steps + 8)
        first = int(prefill(loaded, ids, SummarizeConfig(prefill_chunk_size=2048), cache, "auto").argmax())
        out = [first]
        for _ in range(steps):
            out.append(int(decode_step(loaded.model, [out[-1]], [cache.get_seq_length()], [cache]).argmax()))
        got["per-row alone"].append(out)
        _free(loaded.device)
    return got


def pinned_copy_gbs(device: torch.device, nbytes: int) -> float:
    """How fast pinned host memory reaches the device: what bounds a layer streamed from host RAM."""
    if device.type != "cuda":
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(3):
        target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", help="rows per decode step (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (8192 on CUDA, 256 on the CPU)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--offload-tokens", type=int, help="the long prompt streamed from host RAM")
    parser.add_argument("--report", type=Path, help="also write the figures to this JSON file (after every row)")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds from the start after which rows not yet started are skipped")
    args = parser.parse_args()
    device = torch.device(args.device)
    fields, prompt_tokens, rows_spec, offload_tokens = DEVICE_SHAPES[device.type]
    prompt_tokens = args.prompt_tokens or prompt_tokens
    widths = [int(w) for w in (args.rows or rows_spec).split(",")]
    steps = args.decode_steps
    loaded = synthetic_llama(device, fields)
    read_gbs = device_read_gbs(device, 4 << 30 if device.type == "cuda" else 256 << 20)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, fields["vocab_size"], (prompt_tokens,), generator=generator).tolist()
               for _ in range(max(widths))]
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "model": loaded.name, "prompt_tokens": prompt_tokens, "decode_steps": steps, "read_gbs": read_gbs,
                    "deadline_s": args.deadline, "rows": [], "agreement": [], "skipped": []}
    print(f"{loaded.name} on {report['device']}, {prompt_tokens}-token prompts, {steps} decode steps; memory read at "
          f"{read_gbs:.0f} GB/s; rows not started {args.deadline:.0f} s in are skipped", flush=True)
    print(f"{'rows':>4} {'way':<27} {'tok/s':>9} {'of bound':>8} {'x graph':>7} {'host ms':>8} {'kernels':>7}  note")
    tokens_of: dict[tuple[int, str], list[list[int]]] = {}
    baseline: dict[int, float] = {}
    pooled: PooledPrompts | None = None
    for width, way in device_order(widths):
        if time.monotonic() - STARTED > args.deadline:
            report["skipped"].append({"rows": width, "way": way, "why": f"past the {args.deadline:.0f} s deadline"})
            print(f"{width:>4} {way:<27} skipped: past the {args.deadline:.0f} s deadline", flush=True)
            write_report(args.report, report)
            continue
        if way.endswith("cuDNN off") and device.type != "cuda":
            continue
        if way == BASELINE:
            if pooled is not None:
                pooled.close()
                pooled = None
            _free(device)
            rate, host_ms, kernels, tokens_of[width, way], note = static_cache_graph(loaded, prompts[:width], steps)
            baseline[width] = rate
            _free(device)
        else:
            if pooled is None:
                pooled = PooledPrompts(loaded, prompts[:width], steps)
            rate, host_ms, kernels, tokens_of[width, way] = kvbatch_way(loaded, pooled, way, steps)
            note = "eager (no CUDA graphs on the CPU)" if way == "kvbatch graphed" and device.type != "cuda" else ""
        bound = width * read_gbs * 1e9 / step_bytes(loaded, width, prompt_tokens + steps // 2)
        row = Row(width, way, rate, host_ms, kernels, bound, rate / bound,
                  rate / baseline[width] if width in baseline else None, note)
        report["rows"].append(asdict(row))
        write_report(args.report, report)
        versus = f"{row.x_baseline:>7.2f}" if row.x_baseline is not None else f"{'n/a':>7}"
        print(f"{width:>4} {way:<27} {rate:>9.1f} {row.of_bound:>8.1%} {versus} {host_ms:>8.2f} {kernels:>7}  {note}",
              flush=True)
    if pooled is not None:
        pooled.close()
        _free(device)
    if time.monotonic() - STARTED > args.deadline:
        report["skipped"].append({"agreement": f"past the {args.deadline:.0f} s deadline"})
        print(f"agreement skipped: past the {args.deadline:.0f} s deadline", flush=True)
        write_report(args.report, report)
    else:
        alone = alone_tokens(loaded, prompts, steps)
        print(f"{'rows':>4} {'way':<27} {'= pooled alone':>14} {'= per-row alone':>15}")
        for (width, way), tokens in tokens_of.items():
            count = min(width, ALONE_PROMPTS)
            row = {"rows": width, "way": way, **{f"same_as_{name.replace(' ', '_')}": agreement(tokens[:count], got[:count])
                                                 for name, got in alone.items()}}
            report["agreement"].append(row)
            print(f"{width:>4} {way:<27} {row['same_as_pooled_alone']:>14.1%} {row['same_as_per-row_alone']:>15.1%}",
                  flush=True)
        write_report(args.report, report)
    if time.monotonic() - STARTED > args.deadline:
        report["skipped"].append({"offload": f"past the {args.deadline:.0f} s deadline"})
        print(f"offload rows skipped: past the {args.deadline:.0f} s deadline", flush=True)
        write_report(args.report, report)
    else:
        long_tokens = args.offload_tokens or offload_tokens
        link_gbs = pinned_copy_gbs(device, 1 << 30)
        kv_step = step_bytes(loaded, 1, long_tokens) - step_bytes(loaded, 0, long_tokens)  # the KV a step streams
        report["pinned_copy_gbs"] = link_gbs
        report["offload"] = offload_rates(loaded, long_tokens, 16)
        for row in report["offload"]:
            row["link_bound_tok_s"] = link_gbs * 1e9 / kv_step if link_gbs else None
            share = (f", {row['decode_tok_s'] / row['link_bound_tok_s']:.0%} of the host link's bound (pinned copies at "
                     f"{link_gbs:.1f} GB/s)") if link_gbs else ""
            print(f"{row['prompt_tokens']}-token prompt, {row['cache']:<12}: prefill {row['prefill_s']:6.1f} s, "
                  f"decode {row['decode_tok_s']:7.2f} tok/s{share}", flush=True)
        write_report(args.report, report)


if __name__ == "__main__":
    main()
