"""Batching through the real CLI, and where a batched worker's decode time goes, from its result rows.

Two sections of bench/throughput.py, each one `kvbatch submit` per setting on one shared local Ray:

- mix: real documents of 400-4,000 tokens (licence texts, whole or cut at a paragraph end; those
  over one pass at context 2048 are map-reduced), SmolLM2-135M fp32, 2 workers x 1 thread, with
  `batch.max_sequences=1` and batched; `--mix-long TOKENS` adds one long document (licence texts
  one after another, cut there) of many passes beside them, and says on which workers its passes
  ran. Docs/hour over the batch phase, and where the workers' time
  went: prefill (one sequence at a time), decode steps, the rows' decode time and how much of it they
  spent waiting on another row's prefill (a stall: the worker's one model thread was prefilling).
- cli-step: ~28 short sequences of bench/step_ops.py's model (Llama-3-8B's attention shape, random
  weights, saved to a folder with a word tokenizer so the worker loads it like any model), one worker,
  `batch.attention=pooled`: each sequence's decode tok/s alone (`max_sequences=1`) against in one
  batch of all of them.

The timeline comes from job.log's `pass_kept` lines: each pass's prefill ran for its `prefill_s` and
its decode for its `decode_s` up to its `finished_at`, on the worker that ran it (a dealt chunk on
the worker that took it, not the one that ran its document's merges). A tree whose lines carry no
timings (55cc39a) is timed from its result rows instead: each document as one prefill then one decode
on its row's worker, exact only for single-pass documents. Every setting can be changed with
`--set KEY=VALUE`, given after the bench's own (e.g. a batch engine key), so the same figures can be
taken either way.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import LICENSES, REPO, JobRun, Unfinished, decoded_tokens, local_ray, submit, write_manifest
from step_ops import shaped_model

from runner.engine.model_loader import LoadedModel
from runner.engine.model_registry import word_tokenizer
from storage.checkpoint import load_state

CONFIG = REPO / "configs" / "default.yaml"
MIX_CONTEXT = 2048
MIX_NEW_TOKENS = 120
# (licence file, most tokens): None keeps the whole text, a number cuts it at the last paragraph end
# within that many tokens
MIX = [("Artistic", None), ("CC0-1.0", None), ("LGPL-3", None), ("Apache-2.0", None), ("GPL-1", 1200),
       ("MPL-2.0", None), ("GPL-2", 4000), ("GFDL-1.3", 1800), ("MPL-1.1", 1700), ("LGPL-2.1", 1100),
       ("GFDL-1.2", 700), ("GPL-3", 1500), ("LGPL-2", 3000)]
#: the long document of `--mix-long`: these licence texts one after another, cut at its token count
LONG_PARTS = ["GPL-3", "GFDL-1.3", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "GPL-2", "Artistic", "GFDL-1.2", "MPL-1.1"]
STEP_VOCAB = 1024


# -- the timeline of a worker, from its job.log and result rows ----------------------------------------
@dataclass(frozen=True)
class Span:
    """One pass on the worker that ran it (or, from a tree whose job.log does not time its passes, one
    document on the worker of its row): when its prefill and its decode ran (wall clock)."""

    worker: str
    prefill_s: float
    decode_s: float
    decode_end: float
    tokens: float  # what its decode steps made

    @property
    def decode_start(self) -> float:
        return self.decode_end - self.decode_s

    @property
    def prefill_start(self) -> float:
        return self.decode_start - self.prefill_s

    def stalled_s(self, others: list[Span]) -> float:
        """Seconds of its decode during which another pass's prefill held the worker's model."""
        return sum(max(0.0, min(self.decode_end, o.decode_start) - max(self.decode_start, o.prefill_start))
                   for o in others if o is not self)

    def step_tok_s(self, others: list[Span]) -> float:
        """Its decode tok/s over the decode steps it was in: its decode time less its stalls."""
        return self.tokens / max(self.decode_s - self.stalled_s(others), 1e-9)


def spans(run: JobRun) -> list[Span]:
    """Every pass the run ran, from its `pass_kept` lines; a tree that logs no pass timings (55cc39a):
    every document as one prefill then one decode on its row's worker, exact for single-pass documents."""
    kept = [e for e in run.log if e.get("event") == "pass_kept" and e.get("decode_s") is not None]
    if kept:
        return [Span(e["worker"], e["prefill_s"], e["decode_s"], e["finished_at"], max(e["new_tokens"] - 1, 0)) for e in kept]
    return [Span(r["worker"], r["prefill_s"], r["decode_s"], r["finished_at"], decoded_tokens(r)) for r in run.rows]


@dataclass(frozen=True)
class WorkerTime:
    """Where one worker's batch phase went (seconds)."""

    worker: str
    docs: int  # result rows on it
    passes: int  # passes it ran
    prefill_s: float  # its model prefilling, one sequence at a time
    decode_s: float  # the rest of its time up to its last pass: decode steps
    row_decode_s: float  # the passes' decode time (first token to last), stalls included
    stalled_s: float  # of that, passes waiting on another pass's prefill


def _by_worker(run: JobRun) -> dict[str, list[Span]]:
    by_worker: dict[str, list[Span]] = defaultdict(list)
    for span in spans(run):
        by_worker[span.worker].append(span)
    return dict(sorted(by_worker.items()))


def worker_times(run: JobRun) -> list[WorkerTime]:
    times = []
    for worker, passes in _by_worker(run).items():
        prefill_s = sum(p.prefill_s for p in passes)
        span = max(p.decode_end for p in passes) - run.batch_started_at
        times.append(WorkerTime(worker, sum(r["worker"] == worker for r in run.rows), len(passes), prefill_s,
                                span - prefill_s, sum(p.decode_s for p in passes),
                                sum(p.stalled_s(passes) for p in passes)))
    return times


def step_rates(run: JobRun) -> list[float]:
    """Each pass's decode tok/s in the steps it was in (its stalls taken out)."""
    return [p.step_tok_s(passes) for passes in _by_worker(run).values() for p in passes]


# -- mix: real documents, max_sequences=1 against batched -----------------------------------------
def _cut(loaded: LoadedModel, text: str, most: int) -> str:
    """`text` up to its last paragraph end within `most` tokens."""
    kept = ""
    for paragraph in text.split("\n\n"):
        longer = f"{kept}\n\n{paragraph}" if kept else paragraph
        if len(loaded.tokenizer(longer, add_special_tokens=False).input_ids) > most:
            break
        kept = longer
    return kept


def mix_documents(loaded: LoadedModel, count: int, long_tokens: int = 0) -> list[dict[str, str]]:
    """The first `count` licence texts of MIX, each whole or cut at the last paragraph end within its
    tokens; and with `long_tokens`, the long document first."""
    rows = []
    if long_tokens:
        whole = "\n\n".join((LICENSES / name).read_text(encoding="utf-8") for name in LONG_PARTS)
        rows.append({"id": "long", "text": _cut(loaded, whole, long_tokens)})
    for name, most in MIX[:count]:
        text = (LICENSES / name).read_text(encoding="utf-8")
        rows.append({"id": name.lower(), "text": text if most is None else _cut(loaded, text, most)})
    return rows


def long_passes(run: JobRun) -> str:
    """How many passes the long document took and where they ran: from job.log's `pass_assigned` lines,
    how many of its chunks each worker slot took and when it took its first (seconds into the batch); a
    tree that logs none (55cc39a), the workers its `task_assigned` lines name."""
    [row] = [r for r in run.rows if r["doc_id"] == "long"]
    taken: dict[str, list[float]] = defaultdict(list)
    for e in run.log:
        if e.get("event") == "pass_assigned" and e.get("doc_id") == "long":
            taken[e["worker"]].append(e["ts"] - run.batch_started_at)
    if not taken:
        workers = sorted({e["worker"] for e in run.log if e.get("event") == "task_assigned" and e.get("doc_id") == "long"})
        return f"{row['passes']} passes on {', '.join(workers)}"
    return f"{row['passes']} passes, {row['chunks']} chunks dealt: " + ", ".join(
        f"{len(times)} to {worker} (first at {min(times):.0f} s)" for worker, times in sorted(taken.items()))


def _settings(base: list[str], sequences: str, extra: list[str]) -> list[str]:
    return [*base, f"batch.max_sequences={sequences}", *extra]


def mix_section(loaded: LoadedModel, args: argparse.Namespace) -> dict:
    documents = mix_documents(loaded, args.mix_docs, args.mix_long)
    tokens = [len(loaded.tokenizer(d["text"], add_special_tokens=False).input_ids) for d in documents]
    workers, threads = (int(x) for x in args.mix_layout.split("x"))
    base = [f"summarize.max_new_tokens={MIX_NEW_TOKENS}", f"summarize.context_tokens={MIX_CONTEXT}",
            "summarize.min_context_tokens=1024", "model.dtype=float32", f"workers.count={workers}",
            f"workers.cpus_per_worker={threads}"]
    print(f"{len(documents)} licence texts of {min(tokens)}-{max(tokens)} tokens ({sum(tokens):,} in all), "
          f"{workers} workers x {threads} thread(s); settings: {' '.join(base + args.set)}", flush=True)
    trees = [("this", REPO)] + ([(args.mix_tree.name, args.mix_tree)] if args.mix_tree else [])
    runs: list[tuple[str, JobRun]] = []
    unfinished: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-mix-") as tmp, local_ray(workers * threads) as address:
        manifest = write_manifest(Path(tmp) / "mix.jsonl", documents)
        for sequences in args.mix_sequences.split(","):
            for name, tree in trees:  # the trees side by side for each setting, so a load change hits both
                label = sequences if tree == REPO else f"{sequences} @ {name}"
                job = Path(tmp) / f"job-{sequences}-{name}"
                try:
                    run = submit(manifest, tree / "configs" / "default.yaml", job,
                                 _settings(base, sequences, args.set), address, tree=tree, limit_s=args.mix_limit)
                except Unfinished:
                    ended = load_state(job).results.num_rows
                    unfinished.append({"max_sequences": label, "limit_s": args.mix_limit, "documents_ended": ended})
                    print(f"  max_sequences {label}: not finished within {args.mix_limit:g} s "
                          f"({ended} of {len(documents)} documents ended): killed", flush=True)
                    continue
                runs.append((label, run))
                print(f"  max_sequences {label}: {run.docs_per_hour:.0f} docs/h"
                      + (f"; the long document: {long_passes(run)}" if args.mix_long else ""), flush=True)
    alone = runs[0][1]
    map_reduced = sorted(r["doc_id"] for r in alone.rows if (r["chunks"] or 0) > 1)
    print(f"map-reduced (more than one chunk): {', '.join(map_reduced) or 'none'}")
    width = max(len(label) for label, _ in runs)
    print(f"\n{'max_seq':>{width}} {'batch s':>8} {'docs/h':>7} {'x first':>7} {'prefill s':>9} {'decode s':>8} "
          f"{'row decode s':>12} {'stalled s':>9} {'stalled':>7} {'mean batch':>10} {'same':>5}  prefill s by worker")
    figures = []
    for sequences, run in runs:
        times = worker_times(run)
        row_decode, stalled = sum(t.row_decode_s for t in times), sum(t.stalled_s for t in times)
        figure = {"max_sequences": sequences, "batch_s": run.batch_s, "docs_per_hour": run.docs_per_hour,
                  "ratio": run.docs_per_hour / alone.docs_per_hour, "prefill_s": sum(t.prefill_s for t in times),
                  "decode_s": sum(t.decode_s for t in times), "row_decode_s": row_decode, "stalled_s": stalled,
                  "mean_batch": run.mean_batch, "same_as_first": run.summaries == alone.summaries,
                  "workers": [t.__dict__ for t in times]}
        figures.append(figure)
        print(f"{sequences:>{width}} {run.batch_s:>8.1f} {run.docs_per_hour:>7.0f} {figure['ratio']:>7.2f} "
              f"{figure['prefill_s']:>9.1f} {figure['decode_s']:>8.1f} {row_decode:>12.1f} {stalled:>9.1f} "
              f"{stalled / max(row_decode, 1e-9):>7.1%} {run.mean_batch:>10.2f} {figure['same_as_first']!s:>5}  "
              + " / ".join(f"{t.prefill_s:.1f}" for t in times), flush=True)
    print("\nprefill s: the workers' prefill (one sequence at a time); decode s: the rest of each worker's time up "
          "to its last pass;\nrow decode s: the passes' decode time, first token to last; stalled: the part "
          "of it spent waiting on another\npass's prefill on the same worker (bench/cli_batch.py: each pass on the "
          "worker that ran it)")
    return {"documents": len(documents), "tokens": tokens, "map_reduced": map_reduced, "runs": figures,
            "unfinished": unfinished}


# -- cli-step: one pooled step of ~28 short sequences, through the CLI --------------------------------
def save_step_model(folder: Path) -> None:
    """bench/step_ops.py's model and a word tokenizer as a folder the worker loads; no end token, so every
    sequence decodes `max_new_tokens`."""
    model = shaped_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    word_tokenizer(STEP_VOCAB).save_pretrained(folder)


def step_documents(count: int, words: int) -> list[dict[str, str]]:
    generator = torch.Generator().manual_seed(0)
    return [{"id": f"seq-{i:02d}", "text": " ".join(f"t{t}" for t in torch.randint(
        3, STEP_VOCAB, (words,), generator=generator).tolist())} for i in range(count)]


def cli_step_section(loaded: LoadedModel | None, args: argparse.Namespace) -> dict:
    rows, steps = args.step_rows, args.step_tokens
    with tempfile.TemporaryDirectory(prefix="kvbench-step-") as tmp, local_ray(1) as address:
        folder = Path(tmp) / "llama-8b-attention"
        save_step_model(folder)
        base = [f"model.name={folder}", "model.dtype=float32", "model.device=cpu", "batch.attention=pooled",
                "workers.count=1", "workers.cpus_per_worker=1", f"summarize.max_new_tokens={steps}",
                "summarize.context_tokens=1024", "summarize.min_context_tokens=256", "summarize.loop_stop.enabled=false"]
        print(f"step_ops.py's model (32 layers, 32 q / 8 kv heads, head_dim 128, hidden 64), fp32, 1 worker x 1 thread; "
              f"{rows} sequences of {args.step_words} words, {steps} new tokens each; settings: "
              f"{' '.join(base + args.set)}", flush=True)
        runs = {}
        for label, count, sequences in (("alone", min(rows, 8), 1), ("batched", rows, rows)):
            manifest = write_manifest(Path(tmp) / f"{label}.jsonl", step_documents(count, args.step_words))
            runs[label] = submit(manifest, CONFIG, Path(tmp) / f"job-{label}", _settings(base, str(sequences), args.set),
                                 address)
    print(f"\n{'run':<8} {'sequences':>9} {'mean batch':>10} {'tok/s per seq':>13} {'in steps':>8} {'stalled':>7}")
    figures = {}
    for label, run in runs.items():
        as_rows = [r["decode_tokens_per_s"] for r in run.rows]
        in_steps = step_rates(run)
        times = worker_times(run)
        stalled = sum(t.stalled_s for t in times) / max(sum(t.row_decode_s for t in times), 1e-9)
        figures[label] = {"sequences": len(run.rows), "mean_batch": run.mean_batch,
                          "tok_s_per_sequence": sum(as_rows) / len(as_rows),
                          "tok_s_per_sequence_in_steps": sum(in_steps) / len(in_steps), "stalled_share": stalled}
        f = figures[label]
        print(f"{label:<8} {f['sequences']:>9} {f['mean_batch']:>10.2f} {f['tok_s_per_sequence']:>13.1f} "
              f"{f['tok_s_per_sequence_in_steps']:>8.1f} {stalled:>7.1%}")
    ratio = figures["batched"]["tok_s_per_sequence_in_steps"] / figures["alone"]["tok_s_per_sequence_in_steps"]
    figures["ratio"] = ratio
    print(f"\neach sequence in a batch of {figures['batched']['mean_batch']:.1f} (mean) decodes at {ratio:.2f}x its "
          f"speed alone (in its steps; {figures['batched']['tok_s_per_sequence'] / figures['alone']['tok_s_per_sequence']:.2f}x "
          "with the waits on the others' prefill)")
    return figures
