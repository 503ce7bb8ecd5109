"""Batched decode tok/s of this tree's two attention paths (per-row and pooled) side by side in one
run, on batches of one length and mixed lengths (what `batch.attention: auto` on the CPU is decided
by), and, with `--revision REV`, against an older revision's own engine (88824c8: the code before
issue 21, the commit before b63284c "A worker-wide KV pool", as docs/benchmarks.md measured it).

The revision is checked out with `git worktree add` into a temporary folder (bench/common.py
`revision_tree`) and removed after. Each side is its own process (this script with `--worker`) with its
tree first on sys.path and this checkout's virtual environment: SmolLM2-135M fp32, `--threads` torch threads, the same prompts (real text: licence files
from /usr/share/common-licenses, cut to each shape's lengths), prefilled, then greedy batched decode
steps through `ragged.decode_step` and the tree's own token choice (a `TokenPicker.pick` per row at
88824c8, `choose_tokens` now). Prefill is excluded. The sides are started one after another (so
their prefills do not compete) and then take turns: each round every side decodes `--steps` steps
while the others wait, the order rotating from round to round, so they share the machine's state;
tok/s is the median over rounds, and `x before` (`x per-row`) the median of each round's ratio to the
old revision, or to the first side without one (to this tree's per-row side). Every side's tokens must
equal the first side's (greedy fp32: batching and offloading change no token).

Shapes: `LENGTHxROWS` (every prompt LENGTH tokens) or `mixed:LOW-HIGHxROWS` (lengths spread evenly
from LOW to HIGH, so the pool attends every row up to the longest).

Run: python bench/decode_revisions.py [--shapes 500x16,3000x8,mixed:300-3000x16] [--steps 16]
     [--rounds 3] [--threads 2] [--revision 88824c8] [--json]
     python bench/decode_revisions.py --worker --tree DIR --prompts FILE.json ...  (one side, as the run starts it)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for common.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# a side imports the engine of its own tree: nothing of this checkout (common.py, runner) is imported
# at the top, or a side would run this checkout's code instead of the tree it was given
TEXTS = ("GPL-3", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0")
SCRIPT = Path(__file__).resolve()
ANSWER = "@@ "


@dataclass(frozen=True)
class SideSpec:
    name: str
    tree: Path
    attention: str


class Side:
    """A running side (this script with `--worker`): commands in, answers out."""

    def __init__(self, spec: SideSpec, prompts_file: Path, threads: int, room: int) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", "--tree", str(spec.tree), "--prompts", str(prompts_file),
             "--attention", spec.attention, "--threads", str(threads), "--room", str(room)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=spec.tree)
        try:
            self.ready = self._read()
        except BaseException:  # stopped while it prefills: it is no one's to close
            self.proc.kill()
            raise

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        raise SystemExit(f"{self.spec.name}: the decode worker exited {self.proc.wait()} without answering")

    def close(self) -> None:
        assert self.proc.stdin is not None
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        self.proc.wait()


def corpus() -> list[int]:
    """Token ids of real text: licence files, one after another."""
    from common import LICENSES

    from runner.engine.model_registry import smollm2_tokenizer

    tokenizer = smollm2_tokenizer("builtin:smollm2-135m")
    return [t for name in TEXTS for t in tokenizer((LICENSES / name).read_text(encoding="utf-8"),
                                                    add_special_tokens=False).input_ids]


def lengths_of(shape: str) -> list[int]:
    """Each prompt's length for `LENGTHxROWS` or `mixed:LOW-HIGHxROWS`."""
    spec, rows = shape.rsplit("x", 1)
    count = int(rows)
    if not spec.startswith("mixed:"):
        return [int(spec)] * count
    low, high = (int(x) for x in spec.removeprefix("mixed:").split("-"))
    return [low + round(i * (high - low) / max(count - 1, 1)) for i in range(count)]


def prompts_for(ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Slices of `ids` of the given lengths, each starting somewhere else in the text."""
    return [ids[i * 997 % (len(ids) - n):][:n] for i, n in enumerate(lengths)]


def measure(shape: str, prompts: list[list[int]], specs: list[SideSpec], args: argparse.Namespace) -> dict[str, Any]:
    """Every side's tok/s at `shape`, taking turns, and whether its tokens equal the first side's."""
    room = 1 + args.rounds * args.steps + 8
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    sides: list[Side] = []
    try:
        for spec in specs:  # one at a time: their prefills do not share the cores
            sides.append(Side(spec, Path(f.name), args.threads, room))
            print(f"  {shape}: {spec.name} ready (prefill {sides[-1].ready['prefill_s']:.1f} s, "
                  f"{sides[-1].ready['token_choice']})", flush=True)
        seconds: dict[str, list[float]] = {s.spec.name: [] for s in sides}
        for r in range(args.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                seconds[side.spec.name].append(side.ask(f"steps {args.steps}")["seconds"])
            print(f"  {shape}: round {r + 1}: " + ", ".join(
                f"{name} {len(prompts) * args.steps / s[-1]:.1f} tok/s" for name, s in seconds.items()), flush=True)
        tokens = {s.spec.name: s.ask("tokens")["tokens"] for s in sides}
    finally:
        for side in sides:
            side.close()
        Path(f.name).unlink()
    base, per_row = specs[0].name, specs[1].name
    rows = len(prompts)
    result = {"shape": shape, "rows": rows, "prompt_tokens": [len(p) for p in prompts], "sides": []}
    for spec in specs:
        rates = [rows * args.steps / s for s in seconds[spec.name]]
        ratios = [b / s for b, s in zip(seconds[base], seconds[spec.name], strict=True)]
        per_row_ratios = [b / s for b, s in zip(seconds[per_row], seconds[spec.name], strict=True)]
        same = sum(a == b for a, b in zip(tokens[spec.name], tokens[base], strict=True))
        result["sides"].append({"side": spec.name, "attention": spec.attention, "tok_s": statistics.median(rates),
                                "tok_s_rounds": rates, "x_before": statistics.median(ratios),
                                "x_before_rounds": ratios, "x_per_row": statistics.median(per_row_ratios),
                                "same_tokens": same})
    return result


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{'shape':>18} {'side':>16} {'tok/s':>7} {'x before':>8} {'x before, each round':>24} "
          f"{'x per-row':>9} {'same tokens':>11}")
    for result in results:
        for side in result["sides"]:
            rounds = " ".join(f"{x:.2f}" for x in side["x_before_rounds"])
            print(f"{result['shape']:>18} {side['side']:>16} {side['tok_s']:>7.1f} {side['x_before']:>8.2f} "
                  f"{rounds:>24} {side['x_per_row']:>9.2f} {side['same_tokens']:>8}/{result['rows']}")
    print(f"\nbefore: {args.revision or 'now per-row'}; tok/s: median over {args.rounds} rounds of {args.steps} steps; x before: "
          "median of each round's ratio; x per-row: the same against this tree's per-row side;\nsame tokens: rows whose "
          "tokens equal the before side's")


# -- one side (`--worker`) --------------------------------------------------------------------------
# One side of bench/decode_revisions.py: a process that decodes a fixed batch with the engine of one
# source tree (this checkout, or an older revision checked out beside it), steps on command.
#
# It imports only what exists at both revisions the bench compares (the model loader, generate()'s
# prefill, `BudgetedDynamicCache`, `ragged.decode_step`, `TokenPicker`), with the tree given by `--tree`
# first on sys.path, and chooses each step's tokens as that tree's engine does: each row's own
# `TokenPicker.pick` where the tree has no `choose_tokens`, the batch's `choose_tokens` where it has.
# `--attention pooled` (the current tree only) makes every cache a slot of one `KVPool`.
#
# Protocol, one JSON object a line, each answer on stdout prefixed with `@@ ` (anything else a library
# prints is not an answer): after loading the model and prefilling every prompt (and one untimed step),
# it answers {"ready": ...}; then each "steps N" line runs N batched decode steps and answers their
# seconds; "tokens" answers every row's tokens so far; "quit" ends it.
#
# Run: python bench/decode_revisions.py --worker --tree DIR --prompts FILE.json [--attention per-row|pooled] [--threads 2]
#      [--prefill-threads 1]


def _answer(payload: dict[str, Any]) -> None:
    print(ANSWER + json.dumps(payload), flush=True)


def worker_main() -> None:
    """One side (`--worker`): see the section's comment above."""
    parser = argparse.ArgumentParser(description="one side of the bench: decodes with --tree's engine")
    parser.add_argument("--worker", action="store_true")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="500x16,3000x8,mixed:300-3000x16",
                        help="LENGTHxROWS or mixed:LOW-HIGHxROWS, comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--revision", default=None, help="an older revision to compare with, e.g. 88824c8")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its checkout
    ids = corpus()
    print(f"SmolLM2-135M fp32, {args.threads} torch threads a side, greedy; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    from common import REPO, revision_tree

    results = []
    now = [SideSpec("now per-row", REPO, "per-row"), SideSpec("now pooled", REPO, "pooled")]
    with revision_tree(args.revision) if args.revision else contextlib.nullcontext() as before:
        specs = ([SideSpec(args.revision, before, "per-row")] if args.revision else []) + now
        for shape in args.shapes.split(","):
            results.append(measure(shape, prompts_for(ids, lengths_of(shape)), specs, args))
    print_table(results, args)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps(results))
    different = [f"{r['shape']} {s['side']}" for r in results for s in r["sides"] if s["same_tokens"] != r["rows"]]
    if different:
        raise SystemExit(f"tokens differ from {specs[0].name}'s: {', '.join(different)}")


if __name__ == "__main__":
    worker_main() if "--worker" in sys.argv[1:] else main()
