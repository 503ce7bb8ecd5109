"""One side of bench/decode_revisions.py: a process that decodes a fixed batch with the engine of one
source tree (this checkout, or an older revision checked out beside it), steps on command.

It imports only what exists at both revisions the bench compares (the model loader, generate()'s
prefill, `BudgetedDynamicCache`, `ragged.decode_step`, `TokenPicker`), with the tree given by `--tree`
first on sys.path, and chooses each step's tokens as that tree's engine does: each row's own
`TokenPicker.pick` where the tree has no `choose_tokens`, the batch's `choose_tokens` where it has.
`--attention pooled` (the current tree only) makes every cache a slot of one `KVPool`.

Protocol, one JSON object a line, each answer on stdout prefixed with `@@ ` (anything else a library
prints is not an answer): after loading the model and prefilling every prompt (and one untimed step),
it answers {"ready": ...}; then each "steps N" line runs N batched decode steps and answers their
seconds; "tokens" answers every row's tokens so far; "quit" ends it.

Run: python bench/decode_worker.py --tree DIR --prompts FILE.json [--attention per-row|pooled] [--threads 2]
     [--prefill-threads 1]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ANSWER = "@@ "


def _answer(payload: dict[str, Any]) -> None:
    print(ANSWER + json.dumps(payload), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="the source tree whose engine decodes")
    parser.add_argument("--prompts", type=Path, required=True, help="a JSON list of token id lists")
    parser.add_argument("--attention", default="per-row", choices=["per-row", "pooled"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the decode steps")
    parser.add_argument("--prefill-threads", type=int, default=1, help=(
        "torch threads of the prefill, which is not timed: one thread loses least to a machine shared with "
        "other jobs (every side prefills the same way, so their caches are the same)"))
    parser.add_argument("--room", type=int, default=256, help="tokens each cache holds beyond its prompt")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    import runner
    from jobs.config import ModelConfig, SummarizeConfig
    from runner.engine import generation
    from runner.engine.kvcache import BudgetedDynamicCache
    from runner.engine.ragged import decode_step

    if Path(runner.__file__).resolve().parents[1] != tree:  # an installed copy would measure the wrong code
        raise SystemExit(f"runner imported from {runner.__file__}, not from {tree}")
    try:
        from runner.engine.model_loader import load_model
    except ImportError:  # before the loader was split out of models.py
        from runner.engine.models import load_model

    prompts: list[list[int]] = json.loads(args.prompts.read_text(encoding="utf-8"))
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", dtype="float32", device="cpu"))
    loaded.model.generation_config.eos_token_id = None  # every row decodes every step, as in the old bench
    plain = {"prefill_chunk_size": 512, "generation": {}, "no_repeat_summary_ngram": 0}  # greedy, no processors
    settings = SummarizeConfig(**{k: v for k, v in plain.items() if k in SummarizeConfig.model_fields})
    caches = _caches(loaded, prompts, args.attention, args.room, BudgetedDynamicCache)
    by_loaded = next(iter(inspect.signature(generation.TokenPicker).parameters)) == "loaded"
    pickers = [generation.TokenPicker(loaded if by_loaded else loaded.model, settings, ids, args.room)
               for ids in prompts]
    choose_tokens = getattr(generation, "choose_tokens", None)

    torch.set_num_threads(args.prefill_threads)
    started = time.perf_counter()
    tokens = [[int(generation.prefill(loaded, ids, settings, cache, "auto").argmax())]
              for ids, cache in zip(prompts, caches, strict=True)]
    prefill_s = time.perf_counter() - started
    torch.set_num_threads(args.threads)
    positions = [len(ids) for ids in prompts]

    def step() -> None:
        with torch.inference_mode():
            logits = decode_step(loaded.model, [t[-1] for t in tokens], positions, caches)  # [rows, vocab]
            chosen = choose_tokens(pickers, logits) if choose_tokens is not None else {}
            for row, picker in enumerate(pickers):
                tokens[row].append(picker.take(chosen[row]) if row in chosen else picker.pick(logits[row : row + 1]))
                positions[row] += 1

    step()  # untimed: the batch's first step pays its set-up
    _answer({"ready": True, "prefill_s": prefill_s, "torch": torch.__version__, "threads": torch.get_num_threads(),
             "token_choice": "choose_tokens" if choose_tokens is not None else "pick per row"})
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["steps"]:
            t0 = time.perf_counter()
            for _ in range(int(command[1])):
                step()
            _answer({"seconds": time.perf_counter() - t0})
        elif command == ["tokens"]:
            _answer({"tokens": tokens})
        elif command == ["quit"]:
            break
        else:
            raise SystemExit(f"unknown command {line!r}")
    for cache in caches:
        cache.close()


def _caches(loaded: Any, prompts: list[list[int]], attention: str, room: int, dynamic: type) -> list[Any]:
    """One cache per prompt, each with room for its prompt and `room` new tokens: the per-row path's
    `BudgetedDynamicCache`, or slots of one `KVPool` (the pooled path, present in the current tree only)."""
    if attention == "per-row":
        return [dynamic(loaded.model.config, None, len(ids) + room) for ids in prompts]
    from runner.engine.kvcache import ResidentMeter
    from runner.engine.kvcache.pool import KVPool, PooledCache

    pool = KVPool.for_model(loaded.model.config, loaded.dtype, loaded.device, ResidentMeter(None, "device", ""))
    return [PooledCache(pool, len(ids) + room) for ids in prompts]


if __name__ == "__main__":
    main()
