"""Batched decode tok/s of this tree (per-row and pooled attention) against the code before issue 21,
side by side in one run, and pooled against per-row on a mixed-length batch (what `batch.attention:
auto` on the CPU is decided by).

"Before" is revision 88824c8 (the commit before b63284c, "A worker-wide KV pool"), checked out with
`git worktree add` into a temporary folder (bench/common.py `revision_tree`). Each side is its own
process (bench/decode_worker.py) with its tree first on sys.path and this checkout's virtual
environment: SmolLM2-135M fp32, `--threads` torch threads, the same prompts (real text: licence files
from /usr/share/common-licenses, cut to each shape's lengths), prefilled, then greedy batched decode
steps through `ragged.decode_step` and the tree's own token choice (a `TokenPicker.pick` per row at
88824c8, `choose_tokens` now). Prefill is excluded. The sides are started one after another (so
their prefills do not compete) and then take turns: each round every side decodes `--steps` steps
while the others wait, the order rotating from round to round, so they share the machine's state;
tok/s is the median over rounds, and `x before` (`x per-row`) the median of each round's ratio to the
old revision (to this tree's per-row side). Every side's
tokens must equal the old revision's (greedy fp32: batching and offloading change no token).

Shapes: `LENGTHxROWS` (every prompt LENGTH tokens) or `mixed:LOW-HIGHxROWS` (lengths spread evenly
from LOW to HIGH, so the pool attends every row up to the longest).

Run: python bench/decode_revisions.py [--shapes 500x16,3000x8,mixed:300-3000x16] [--steps 16]
     [--rounds 3] [--threads 2] [--revision 88824c8] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for common.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import LICENSES, REPO, revision_tree

from runner.engine.model_registry import smollm2_tokenizer

BEFORE = "88824c8"
"""The first-parent commit just before the worker-wide KV pool (b63284c): the code issue 21 measured."""
TEXTS = ("GPL-3", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0")
WORKER = Path(__file__).resolve().parent / "decode_worker.py"
ANSWER = "@@ "


@dataclass(frozen=True)
class SideSpec:
    name: str
    tree: Path
    attention: str


class Side:
    """A running bench/decode_worker.py: commands in, answers out."""

    def __init__(self, spec: SideSpec, prompts_file: Path, threads: int, room: int) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--tree", str(spec.tree), "--prompts", str(prompts_file),
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
    print(f"\nbefore: {args.revision}; tok/s: median over {args.rounds} rounds of {args.steps} steps; x before: "
          "median of each round's ratio; x per-row: the same against this tree's per-row side;\nsame tokens: rows whose "
          "tokens equal the before side's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="500x16,3000x8,mixed:300-3000x16",
                        help="LENGTHxROWS or mixed:LOW-HIGHxROWS, comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--revision", default=BEFORE, help="the code to compare with")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its checkout
    ids = corpus()
    print(f"SmolLM2-135M fp32, {args.threads} torch threads a side, greedy; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    with revision_tree(args.revision) as before:
        specs = [SideSpec(args.revision, before, "per-row"), SideSpec("now per-row", REPO, "per-row"),
                 SideSpec("now pooled", REPO, "pooled")]
        for shape in args.shapes.split(","):
            results.append(measure(shape, prompts_for(ids, lengths_of(shape)), specs, args))
    print_table(results, args)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps(results))
    different = [f"{r['shape']} {s['side']}" for r in results for s in r["sides"] if s["same_tokens"] != r["rows"]]
    if different:
        raise SystemExit(f"tokens differ from {args.revision}'s: {', '.join(different)}")


if __name__ == "__main__":
    main()
