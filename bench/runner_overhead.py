"""What kvbatch costs over a plain `model.generate` loop, measured side by side in one run.

The same documents go through `kvbatch submit` (one worker, its own local Ray) and through a loop in
this process that loads the model with the same loader and summarises with the same Summarizer,
chat template, prompt and generation settings (only the KV cache is transformers' default instead
of kvbatch's planned one). The ratio compares the batch phase (last worker ready -> batch end, from
job.log) with the loop (model already loaded); Ray start-up and the worker's model load are fixed
costs paid once per batch, so they are printed separately. The plain loop runs before and after
kvbatch and the ratio uses their mean, so a machine getting busier or quieter during the run
shows as a spread between the two instead of as overhead; the CPU seconds of the worker process
and of the plain loop are compared too, which other load on the machine barely moves. With greedy
decoding both paths must write the same summaries, which the table checks.

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

import psutil  # noqa: E402
import torch  # noqa: E402

from jobs.config import JobConfig, load_config  # noqa: E402
from jobs.documents import read_document_text  # noqa: E402
from runner.engine.generation import generate_once  # noqa: E402
from runner.engine.models import load_model  # noqa: E402
from runner.engine.summarize import Summarizer  # noqa: E402
from runner.observe.joblog import read_log  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
DEFAULT_DOCS = ["BSD", "CC0-1.0", "Artistic", "LGPL-3"]
TARGET_RATIO = 1.10


@dataclass
class PlainRun:
    load_s: float
    summarise_s: float
    cpu_s: float
    summaries: dict[str, str]


@dataclass
class BatchRun:
    wall_s: float
    startup_s: float  # CLI, manifest, job folder and Ray start-up, until the coordinator starts workers
    worker_start_s: float  # actor processes and imports, the model load excluded
    load_s: float  # the worker's model load
    summarise_s: float  # last worker ready -> batch end
    finish_s: float  # compaction, Ray shut-down, process exit
    worker_cpu_s: float  # the worker process's CPU seconds over the batch phase
    summaries: dict[str, str]


@dataclass
class WorkerCpu:
    """Follows job.log while the batch runs: the worker's CPU seconds from `worker_ready` to `batch_end`."""

    log: Path
    process: psutil.Process | None = None
    at_ready: float = 0.0
    latest: float = 0.0
    ended: bool = False

    def sample(self) -> None:
        if self.ended:
            return
        events = {e["event"]: e for e in read_log(self.log)}
        try:
            if self.process is None and "worker_ready" in events:
                self.process = psutil.Process(int(events["worker_ready"]["worker"].rsplit(":", 1)[1]))
                self.at_ready = self.latest = sum(self.process.cpu_times()[:2])
            elif self.process is not None:
                self.latest = sum(self.process.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
        self.ended = "batch_end" in events

    @property
    def cpu_s(self) -> float:
        return self.latest - self.at_ready


def plain_loop(cfg: JobConfig, paths: list[Path], threads: int) -> PlainRun:
    torch.set_num_threads(threads)  # what the worker does with workers.cpus_per_worker
    start = time.perf_counter()
    loaded = load_model(cfg.model)
    load_s = time.perf_counter() - start
    summarizer = Summarizer(loaded, cfg.summarize.chunk_overlap_tokens)
    settings = cfg.summarize
    summaries = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for path in paths:
        text = read_document_text(path, max_bytes=cfg.input.max_document_bytes, documents_root=None)
        summary = summarizer.summarize(
            text, settings.prompt, settings.max_new_tokens, settings.context_tokens,
            lambda ids, max_new: generate_once(loaded, ids, max_new, settings, {}),
        )
        summaries[path.name.lower()] = summary.text
    return PlainRun(load_s, time.perf_counter() - start, time.process_time() - cpu_start, summaries)


def kvbatch_run(manifest: Path, job: Path, config: Path, overrides: list[str]) -> BatchRun:
    sets = [arg for item in overrides for arg in ("--set", item)]
    cmd = [sys.executable, "-m", "runner", "submit", str(manifest), "-c", str(config), "-j", str(job), *sets]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker_cpu = WorkerCpu(job / "job.log")
    while proc.poll() is None:
        worker_cpu.sample()
        time.sleep(0.05)
    ended = time.time()
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"kvbatch submit failed ({proc.returncode}):\n{out}\n{err}")
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
        worker_cpu_s=worker_cpu.cpu_s,
        summaries={r["doc_id"]: r["summary"] for r in rows if r["status"] == "done"},
    )


def print_table(model: str, n_docs: int, threads: int, plain: list[PlainRun], batch: BatchRun) -> None:
    def row(label: str, ours: float | None, *theirs: float | None) -> None:
        cell = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"  # noqa: E731
        print(f"{label:<44}{cell(ours)}" + "".join(cell(v) for v in theirs))

    plain_s = sum(p.summarise_s for p in plain) / len(plain)
    plain_cpu_s = sum(p.cpu_s for p in plain) / len(plain)
    same = sum(batch.summaries.get(doc) == text for doc, text in plain[0].summaries.items())
    ratio = batch.summarise_s / plain_s
    load = os.getloadavg()[0]
    print(f"\n{model}, {n_docs} documents, 1 worker, {threads} torch thread(s); load average now {load:.1f}")
    print(f"{'seconds':<44}{'kvbatch':>10}" + "".join(f"{f'plain {i + 1}':>10}" for i in range(len(plain))))
    row("Ray + CLI start-up (until workers start)", batch.startup_s, *[None] * len(plain))
    row("worker process start (model load excluded)", batch.worker_start_s, *[None] * len(plain))
    row("model load", batch.load_s, *[p.load_s for p in plain])
    row("summarise all documents (wall)", batch.summarise_s, *[p.summarise_s for p in plain])
    row("summarise all documents (CPU of the loop)", batch.worker_cpu_s, *[p.cpu_s for p in plain])
    row("after the batch (compaction, Ray shut-down)", batch.finish_s, *[None] * len(plain))
    row("total wall", batch.wall_s, *[p.load_s + p.summarise_s for p in plain])
    verdict = "within" if ratio <= TARGET_RATIO else "OVER"
    print(f"ratio kvbatch / plain (mean), summarise wall: {ratio:.3f} ({verdict} the {TARGET_RATIO:.2f} target); "
          f"CPU: {batch.worker_cpu_s / plain_cpu_s:.3f}")
    print(f"identical summaries: {same}/{len(plain[0].summaries)}")


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
        before = plain_loop(cfg, paths, args.threads)
        batch = kvbatch_run(manifest, Path(tmp) / "job", args.config, overrides)
        after = plain_loop(cfg, paths, args.threads)
    print_table(args.model, len(paths), args.threads, [before, after], batch)


if __name__ == "__main__":
    main()
