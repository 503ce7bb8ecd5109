"""Budget-proportional placement on SmolLM2-135M: a decode step moves only the KV that does not fit.

At the largest of --contexts, side by side in one run: everything resident (`dynamic`), everything
streamed (a tiered cache without a placement), and device budgets of 25 %, 50 % and 75 % of the
cache planned by `jobs.kvplan.plan_placement`, on tiered-host and tiered-disk. For each: bytes
moved per decode step as planned (the plan's overflow) and as measured (what the cache's copies
wrote, added up at the copy sites in runner/engine/kvcache: tier reads into the layer's buffers,
new tokens into the RAM tail) side by side, their ratio, decode tokens/s and its ratio to
dynamic's, resident KV peak against the budget, and whether the tokens are dynamic's. Registered
in bench/offload.py as the `placement` section:

    python bench/offload.py --sections placement --threads 1 --new-tokens 16
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from offload_common import fmt, real_prompt, run_one  # bench/ is on sys.path as a script

from jobs.kvplan import KVShape, Placement, kv_bytes, plan_placement
from jobs.rungs import RUNGS
from runner.engine.kvcache import kv_shape
from runner.engine.model_loader import LoadedModel

MiB = 1 << 20
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
