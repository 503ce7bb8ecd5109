"""A long prompt joining a decoding batch: prefilled whole (batch.prefill_chunk_tokens 0) or riding
the decode steps chunk by chunk, side by side in one run on the builtin SmolLM2.

`--rows` short prompts decode together; once they all do, a long prompt joins. Each row is the
worker's own engine (`BatchEngine`, `dynamic` caches, greedy fp32, loop stop off) with one
setting of the chunk; the clock is read after every decode step's token choice, where the batch's
rows get their tokens. The table gives the decoders' longest wait between two tokens (the stall a
whole prefill is), the decode steps they made while the long prompt prefilled, the long prompt's time
to its first token, and the wall time of the whole batch; every row's tokens must equal the whole
prefill's (the script fails otherwise).

Run: python bench/prefill_rides.py [--rows 4] [--long-prompt 1536] [--chunk 256] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MANIFEST = REPO / "examples" / "licenses.jsonl"


def _texts() -> list[str]:
    rows = [json.loads(line) for line in MANIFEST.read_text().splitlines() if line.strip()]
    return [r["text"] if "text" in r else Path(r["path"]).read_text(encoding="utf-8", errors="replace")
            for r in rows]


def run(loaded, chunk: int, short: list[list[int]], long: list[int], new_tokens: int) -> dict:
    """One row: the short prompts decode, the long one joins; the figures of that batch."""
    from jobs.config import CacheConfig, SummarizeConfig
    from runner.engine.batch_engine import BatchEngine, PassRequest
    from runner.engine.kvcache import build_cache
    from runner.engine.probes import StageMemory
    from runner.engine.worker import _is_memory_error

    class StepClock(BatchEngine):
        """The engine, with the time of each decode step's token choice."""

        def __init__(self, *args, **kwargs) -> None:
            self.ticks: list[float] = []
            super().__init__(*args, **kwargs)

        def _choose(self, rows, logits) -> None:
            super()._choose(rows, logits)
            if rows:
                self.ticks.append(time.perf_counter())

    # every row runs its full length: no loop stop, no early end-of-sequence
    settings = SummarizeConfig(loop_stop={"enabled": False}, generation={"min_new_tokens": new_tokens})
    engine = StepClock(loaded, settings, "auto", len(short) + 1, 1 << 50, _is_memory_error,
                          prefill_chunk_tokens=chunk)

    def request(prompt: list[int], new: int) -> PassRequest:
        return PassRequest(prompt, new, make_cache=lambda: build_cache("dynamic", loaded.model, CacheConfig(), None, None),
                           device_bytes=0, memory=StageMemory())

    started = time.perf_counter()
    futures = [engine.submit(request(p, new_tokens)) for p in short]
    while engine.most_rows < len(short):  # every short prompt decodes: now the long one joins
        if any(f.done() for f in futures):
            raise SystemExit("a short prompt finished before all of them decoded: raise --new-tokens")
        time.sleep(0.001)
    joined_at = time.perf_counter()
    first_step, rode_before = len(engine.ticks), engine.steps_with_prefill
    long_future = engine.submit(request(long, 16))
    passes = [f.result().generation for f in futures]
    long_pass = long_future.result().generation
    wall = time.perf_counter() - started
    engine.close()
    long_first = joined_at + long_pass.ttft_s
    ticks = engine.ticks[max(first_step - 1, 0) :]
    gaps = [b - a for a, b in itertools.pairwise(ticks) if a <= long_first]  # until the long prompt decodes too
    return {
        "chunk": chunk,
        "longest_wait_s": max(gaps, default=0.0),
        "decode_steps_while_prefilling": engine.steps_with_prefill - rode_before,  # nobody joins after it
        "long_ttft_s": long_pass.ttft_s,
        "wall_s": wall,
        "tokens": [p.tokens for p in passes] + [long_pass.tokens],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="short prompts decoding when the long one joins")
    parser.add_argument("--short-prompt", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=1536)
    parser.add_argument("--new-tokens", type=int, default=96, help="the short prompts' new tokens")
    parser.add_argument("--chunk", type=int, default=256, help="batch.prefill_chunk_tokens of the riding row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from jobs.config import ModelConfig
    from runner.engine.model_loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", device="cpu"))
    ids = [loaded.tokenizer(text, add_special_tokens=False)["input_ids"] for text in _texts()]
    short = [doc[: args.short_prompt] for doc in ids[: args.rows]]
    long = next(doc for doc in sorted(ids, key=len, reverse=True))[: args.long_prompt]
    run(loaded, args.chunk, short[:1], long[:64], 4)  # warm-up: the shapes' first calls pay their set-up
    rows = [run(loaded, chunk, short, long, args.new_tokens) for chunk in (0, args.chunk)]
    whole, rides = rows
    if rides["tokens"] != whole["tokens"]:
        raise SystemExit("riding changed a token: a bug (greedy fp32 tokens must be identical)")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=2))
        return
    print(f"SmolLM2-135M, CPU {args.threads} threads: {args.rows} rows of {args.short_prompt}-token prompts decode, "
          f"a {len(long)}-token prompt joins (greedy fp32 tokens identical in both rows)\n")
    print("| prefill of the joining prompt | decoders' longest wait (s) | decode steps while it prefilled | "
          "its TTFT (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for r, label in ((whole, "whole (`prefill_chunk_tokens: 0`)"), (rides, f"rides, {args.chunk}-token chunks")):
        print(f"| {label} | {r['longest_wait_s']:.2f} | {r['decode_steps_while_prefilling']} | "
              f"{r['long_ttft_s']:.2f} | {r['wall_s']:.2f} |")
    print(f"\nrides / whole: longest wait {rides['longest_wait_s'] / whole['longest_wait_s']:.2f}x, "
          f"TTFT {rides['long_ttft_s'] / whole['long_ttft_s']:.2f}x, wall {rides['wall_s'] / whole['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
