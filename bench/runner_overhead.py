"""What kvbatch costs over a plain `model.generate` loop, measured side by side in one run.

The same documents go through `kvbatch submit` (one worker, its own local Ray) and through a loop in
this process that loads the model with the same loader and summarises with the same Summarizer,
chat template, prompt and generation settings (only the KV cache is transformers' default instead
of kvbatch's planned one). The ratio compares the batch phase (last worker ready -> batch end, from
job.log) with the loop (model already loaded); Ray start-up and the worker's model load are fixed
costs paid once per batch, so they are printed separately. With greedy decoding both paths must
write the same summaries, which the table checks.

Run: python bench/runner_overhead.py [--model builtin:tiny-random] [--docs BSD CC0-1.0 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from jobs.config import JobConfig, load_config  # noqa: E402
from jobs.documents import read_document_text  # noqa: E402
from runner.generation import generate_once  # noqa: E402
from runner.joblog import read_log  # noqa: E402
from runner.models import load_model  # noqa: E402
from runner.summarize import Summarizer  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
DEFAULT_DOCS = ["BSD", "CC0-1.0", "Artistic", "LGPL-3", "MPL-2.0"]
TARGET_RATIO = 1.10


@dataclass
class PlainRun:
    load_s: float
    summarise_s: float
    summaries: dict[str, str]


@dataclass
class BatchRun:
    wall_s: float
    startup_s: float  # CLI, manifest, job folder and Ray start-up, until the coordinator starts workers
    worker_start_s: float  # actor processes and imports, the model load excluded
    load_s: float  # the worker's model load
    summarise_s: float  # last worker ready -> batch end
    finish_s: float  # compaction, Ray shut-down, process exit
    summaries: dict[str, str]


def plain_loop(cfg: JobConfig, paths: list[Path], threads: int) -> PlainRun:
    torch.set_num_threads(threads)  # what the worker does with workers.cpus_per_worker
    start = time.perf_counter()
    loaded = load_model(cfg.model)
    load_s = time.perf_counter() - start
    summarizer = Summarizer(loaded, cfg.summarize.chunk_overlap_tokens)
    settings = cfg.summarize
    summaries = {}
    start = time.perf_counter()
    for path in paths:
        text = read_document_text(path, max_bytes=cfg.input.max_document_bytes, documents_root=None)
        summary = summarizer.summarize(
            text, settings.prompt, settings.max_new_tokens, settings.context_tokens,
            lambda ids, max_new: generate_once(loaded, ids, max_new, settings, {}),
        )
        summaries[path.name.lower()] = summary.text
    return PlainRun(load_s, time.perf_counter() - start, summaries)


def kvbatch_run(manifest: Path, job: Path, config: Path, overrides: list[str]) -> BatchRun:
    sets = [arg for item in overrides for arg in ("--set", item)]
    cmd = [sys.executable, "-m", "runner", "submit", str(manifest), "-c", str(config), "-j", str(job), *sets]
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"kvbatch submit failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    log = read_log(job / "job.log")
    first = {e["event"]: e for e in reversed(log)}  # each event's first occurrence
    ready = [e for e in log if e["event"] == "worker_ready"]
    last_ready = max(e["ts"] for e in ready)
    load_s = max(e["load_s"] for e in ready)
    exported = subprocess.run([sys.executable, "-m", "runner", "results", str(job)], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in exported.splitlines()]
    return BatchRun(
        wall_s=ended - started,
        startup_s=first["batch_start"]["ts"] - started,
        worker_start_s=last_ready - first["batch_start"]["ts"] - load_s,
        load_s=load_s,
        summarise_s=first["batch_end"]["ts"] - last_ready,
        finish_s=ended - first["batch_end"]["ts"],
        summaries={r["doc_id"]: r["summary"] for r in rows if r["status"] == "done"},
    )


def print_table(model: str, n_docs: int, threads: int, plain: PlainRun, batch: BatchRun) -> None:
    def row(label: str, ours: float | None, theirs: float | None) -> None:
        cell = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"  # noqa: E731
        print(f"{label:<44}{cell(ours)}{cell(theirs)}")

    same = sum(batch.summaries.get(doc) == text for doc, text in plain.summaries.items())
    ratio = batch.summarise_s / plain.summarise_s
    print(f"\n{model}, {n_docs} documents, 1 worker, {threads} torch thread(s)")
    print(f"{'seconds':<44}{'kvbatch':>10}{'plain':>10}")
    row("Ray + CLI start-up (until workers start)", batch.startup_s, None)
    row("worker process start (model load excluded)", batch.worker_start_s, None)
    row("model load", batch.load_s, plain.load_s)
    row("summarise all documents", batch.summarise_s, plain.summarise_s)
    row("after the batch (compaction, Ray shut-down)", batch.finish_s, None)
    row("total wall", batch.wall_s, plain.load_s + plain.summarise_s)
    verdict = "within" if ratio <= TARGET_RATIO else "OVER"
    print(f"ratio kvbatch / plain, summarise: {ratio:.3f} ({verdict} the {TARGET_RATIO:.2f} target)")
    print(f"identical summaries: {same}/{len(plain.summaries)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--docs", nargs="+", default=DEFAULT_DOCS, help=f"names in {LICENSES}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the worker's cpus_per_worker)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    args = parser.parse_args()

    overrides = [f"model.name={args.model}", f"summarize.max_new_tokens={args.max_new_tokens}",
                 "workers.count=1", f"workers.cpus_per_worker={args.threads}"]
    cfg = load_config(args.config, overrides)
    paths = [LICENSES / name for name in args.docs]
    with tempfile.TemporaryDirectory(prefix="kvbatch-bench-") as tmp:
        manifest = Path(tmp) / "manifest.jsonl"
        manifest.write_text("".join(json.dumps({"id": p.name.lower(), "path": str(p)}) + "\n" for p in paths))
        plain = plain_loop(cfg, paths, args.threads)
        batch = kvbatch_run(manifest, Path(tmp) / "job", args.config, overrides)
    print_table(args.model, len(paths), args.threads, plain, batch)


if __name__ == "__main__":
    main()
