"""Quantized weights side by side on the same real documents, and what the loop stop saves.

Each row loads the builtin SmolLM2 one way (full precision float32, `model.dtype: bfloat16`, and each
`model.quantization` this machine runs) in a process of its own, so its peak memory is its own, and
summarises the same documents through the worker's engine (one batch, `dynamic` cache, greedy).
The table gives docs/hour, decode tok/s, the weights' bytes, the process's peak RSS, and how close
each row's summaries are to float32's: the share of tokens agreeing up to the first difference and
the ROUGE-L F1 of their words. The rows run with the loop stop off, so every row decodes the same
number of steps and the comparison is of the weights alone.

Then the loop stop on the float32 summaries (run `--rows float32` for this part alone): the
repeated-4-gram share of each (the share of its 4-grams that occurred earlier in it), without and with
the default `summarize.loop_stop` (exact copies and near-copies), and the decode tokens it saves. Greedy decoding makes this exact after the fact: the batched decode stops at
the step where `jobs.stopping.loop_stopped` cuts (tests/test_batching.py holds it to that).

Run: python bench/quantization.py [--docs N] [--prompt-tokens 1024] [--new-tokens 120] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.config import LoopStopConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MANIFEST = REPO / "examples" / "licenses.jsonl"
ROWS = {  # label -> model config
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "bnb-8bit": {"dtype": "float32", "quantization": "bnb-8bit"},
    "bnb-4bit": {"dtype": "float32", "quantization": "bnb-4bit"},
    "torchao-int8": {"dtype": "float32", "quantization": "torchao-int8"},
    "torchao-int4": {"dtype": "bfloat16", "quantization": "torchao-int4"},  # CUDA only
}


def _documents(count: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in MANIFEST.read_text().splitlines() if line.strip()][:count]
    return [(r["id"], r["text"] if "text" in r else Path(r["path"]).read_text(encoding="utf-8", errors="replace"))
            for r in rows]


def child(label: str, args: argparse.Namespace) -> dict:
    """One row: load the model its way, summarise every document in one batch, report figures."""
    import torch

    from jobs.config import CacheConfig, LoopStopConfig, ModelConfig, SummarizeConfig
    from jobs.stopping import loop_stopped
    from runner.engine.batch_engine import BatchEngine, PassRequest
    from runner.engine.kvcache import build_cache
    from runner.engine.model_loader import load_model
    from runner.engine.probes import StageMemory
    from runner.engine.summarize import Summarizer
    from runner.engine.worker import _is_memory_error

    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", device="cpu", **ROWS[label]))
    summarizer = Summarizer(loaded, 0)
    generation = json.loads(args.generation) if args.generation else SummarizeConfig().generation
    summary_ngram = SummarizeConfig().no_repeat_summary_ngram if args.no_repeat_summary_ngram is None \
        else args.no_repeat_summary_ngram
    settings = SummarizeConfig(max_new_tokens=args.new_tokens, generation=generation,
                               no_repeat_summary_ngram=summary_ngram, loop_stop={"enabled": False})
    prompts = []
    for _, text in _documents(args.docs):
        ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][: args.prompt_tokens]
        prompts.append(summarizer.prompt_ids(settings.prompt, loaded.tokenizer.decode(ids)))
    engine = BatchEngine(loaded, settings, "auto", len(prompts), 1 << 50, _is_memory_error,
                               prefill_chunk_tokens=0)  # prompts prefilled whole, one at a time: prefill_s below
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        futures = [engine.submit(PassRequest(
            p, args.new_tokens,
            make_cache=lambda: build_cache("dynamic", loaded.model, CacheConfig(), Path(scratch), None),
            device_bytes=0, memory=StageMemory())) for p in prompts]
        passes = [f.result().generation for f in futures]
    wall = time.perf_counter() - started
    engine.close()
    prefill_s = sum(p.ttft_s for p in passes)  # prompts are prefilled one at a time, decode steps are shared
    return {
        "label": label, "tokens": [p.tokens for p in passes],
        "texts": [loaded.tokenizer.decode(p.tokens, skip_special_tokens=True) for p in passes],
        "kept_texts": [loaded.tokenizer.decode(loop_stopped(p.tokens, LoopStopConfig())[0], skip_special_tokens=True)
                       for p in passes],
        "wall_s": wall, "decode_steps_s": wall - prefill_s, "load_s": loaded.load_s,
        "prefill_s": prefill_s, "decoded": sum(len(p.tokens) - 1 for p in passes),
        "weight_bytes": loaded.weight_bytes, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 over lower-cased words (longest common subsequence)."""
    a, b = reference.lower().split(), candidate.lower().split()
    if not a or not b:
        return 0.0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if not lcs:
        return 0.0
    precision, recall = lcs / len(b), lcs / len(a)
    return 2 * precision * recall / (precision + recall)


def agreement(reference: list[int], candidate: list[int]) -> float:
    """Share of the reference's tokens the candidate matches before they first differ."""
    same = 0
    for x, y in zip(reference, candidate):
        if x != y:
            break
        same += 1
    return same / max(len(reference), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=120)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", nargs="*", default=list(ROWS))
    parser.add_argument("--generation", help="summarize.generation as JSON (default: the default settings')")
    parser.add_argument("--no-repeat-summary-ngram", type=int,
                        help="summarize.no_repeat_summary_ngram (default: the default settings')")
    parser.add_argument("--texts", action="store_true", help="print each float32 summary, as the loop stop keeps it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    from jobs.config import LoopStopConfig, SummarizeConfig
    from runner.engine.model_loader import resolve_device
    from runner.engine.quantization import unavailable

    device = resolve_device("cpu").type
    results = {}
    for label in args.rows:
        why = unavailable(ROWS[label].get("quantization", "none"), device)
        if why:
            print(f"{label}: skipped, {why}", file=sys.stderr)
            continue
        out = subprocess.run([sys.executable, __file__, "--child", label, "--docs", str(args.docs),
                              "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                              "--threads", str(args.threads), *(["--generation", args.generation] if args.generation else []),
                              *(["--no-repeat-summary-ngram", str(args.no_repeat_summary_ngram)]
                                if args.no_repeat_summary_ngram is not None else [])],
                             capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            print(f"{label}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{label}: done in {results[label]['wall_s']:.0f} s", file=sys.stderr)

    base = results["float32"]
    docs = len(base["tokens"])
    print(f"\n{docs} documents of examples/licenses.jsonl (first {args.prompt_tokens} tokens each), one batch, "
          f"{args.new_tokens} new tokens, greedy, loop stop off, {args.threads} threads, SmolLM2-135M on the CPU, "
          f"summarize.generation {args.generation or json.dumps(SummarizeConfig().generation)}, "
          f"summarize.no_repeat_summary_ngram {SummarizeConfig().no_repeat_summary_ngram if args.no_repeat_summary_ngram is None else args.no_repeat_summary_ngram}\n")
    print("| weights | docs/hour | decode tok/s | prefill s | weights MiB | peak RSS MiB | identical | "
          "token agreement | ROUGE-L vs float32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        agree = [agreement(a, b) for a, b in zip(base["tokens"], r["tokens"])]
        rouge = [rouge_l(a, b) for a, b in zip(base["texts"], r["texts"])]
        same = sum(a == b for a, b in zip(base["tokens"], r["tokens"]))
        print(f"| {label} | {docs / r['wall_s'] * 3600:,.0f} | {r['decoded'] / r['decode_steps_s']:.1f} | "
              f"{r['prefill_s']:.1f} | {r['weight_bytes'] / 2**20:.0f} | {r['peak_rss'] / 2**20:.0f} | "
              f"{same}/{docs} | {sum(agree) / docs:.2f} | {min(rouge):.2f}-{max(rouge):.2f} |")

    rule = LoopStopConfig()
    print(f"\nloop stop (default: {rule.repeats} copies of a {rule.ngram}-{rule.max_period} token block, or "
          f"{rule.window_share:.0%} of the last {rule.window} tokens' {rule.ngram}-grams seen before) "
          "on the float32 summaries:\n")
    ids = [json.loads(line)["id"] for line in MANIFEST.read_text().splitlines() if line.strip()]
    print(loop_stop_table(ids, base["tokens"], rule))
    if args.texts:
        for doc, text in zip(ids, base["kept_texts"]):
            print(f"\n== {doc}:\n{text}")


def loop_stop_table(ids: list[str], summaries: list[list[int]], rule: LoopStopConfig) -> str:
    """Each summary decoded without the loop stop, and with it: the tokens decoded before it stopped
    (what the batched decode pays for), the tokens kept, their repeated-4-gram shares, and the decode
    tokens saved (those it did not decode)."""
    from jobs.stopping import LoopWatch, repeated_ngram_share

    lines = ["| document | tokens | repeated 4-grams | with loop stop: decoded | kept | repeated 4-grams | "
             "decode tokens saved |", "|---|---:|---:|---:|---:|---:|---:|"]
    saved_total = 0
    for doc, tokens in zip(ids, summaries):
        watch = LoopWatch(rule)
        kept = watch.kept(tokens)
        decoded = len(watch.tokens) if watch.cut else len(tokens)
        saved_total += len(tokens) - decoded
        lines.append(f"| {doc} | {len(tokens)} | {repeated_ngram_share(tokens):.0%} | {decoded} | {len(kept)} | "
                     f"{repeated_ngram_share(kept):.0%} | {len(tokens) - decoded} |")
    total = sum(len(t) for t in summaries)
    lines.append(f"\ndecode tokens saved: {saved_total} of {total} ({saved_total / total:.0%})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
