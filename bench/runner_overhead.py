"""What kvbatch costs over plain transformers code, measured side by side in one run.

The same documents go through `kvbatch submit` (one worker, its own local Ray) and through the loop
a user would write without kvbatch: AutoTokenizer + AutoModelForCausalLM.from_pretrained from the
same local safetensors folder kvbatch loads (for `builtin:smollm2-135m` the converted copy in
kvbatch's model cache; `builtin:tiny-random` is saved to a folder first and both load that), the
chat template, and `model.generate` with its default cache, greedy, the same max_new_tokens. No
kvbatch code runs in that loop: not its loader, prompt builder, generate helper or KV cache. Each
document must fit one pass at `summarize.context_tokens` (the plain loop does no map-reduce).

The ratio compares the batch phase (last worker ready -> batch end, from job.log) with the loop
(model already loaded); Ray start-up and the worker's model load are fixed costs paid once per
batch, so they are printed separately. The plain loop runs before and after kvbatch and the ratio
uses their mean, so a machine getting busier or quieter during the run shows as a spread between
the two instead of as overhead; the CPU seconds of the worker process and of the plain loop are
compared too, which other load on the machine barely moves. Both decode greedily, so the summaries
should match; the table says how many do (kvbatch prefills in `prefill_chunk_size` chunks, plain
generate in one pass, so float rounding may part them) and prints any that differ.

Run: python bench/runner_overhead.py [--model builtin:tiny-random] [--docs BSD CC0-1.0 ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import LICENSES, REPO, submit, write_manifest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jobs.config import ModelConfig, load_config
from runner.engine.model_loader import load_model
from runner.engine.model_registry import BUILTIN_PREFIX, TINY_RANDOM, builtin_model_dir
from runner.observe.joblog import read_log

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
    map_reduced: dict[str, int]  # documents kvbatch split into chunks: not what the plain loop did


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


def plain_transformers(source: Path | str, paths: list[Path], instruction: str, max_new_tokens: int,
                       context_tokens: int, device: str, dtype: torch.dtype, threads: int) -> PlainRun:
    """Summarise `paths` the way a user would with transformers alone: no kvbatch code below."""
    torch.set_num_threads(threads)  # what the worker does with workers.cpus_per_worker
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    load_s = time.perf_counter() - start
    summaries = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for path in paths:
        messages = [{"role": "user", "content": f"{instruction}\n\n{path.read_text(encoding='utf-8')}"}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(device)
        prompt_tokens = inputs["input_ids"].shape[1]
        if prompt_tokens + max_new_tokens > context_tokens:
            raise SystemExit(f"{path}: {prompt_tokens} prompt tokens + {max_new_tokens} new ones do not fit one pass "
                             f"of {context_tokens} tokens, and the plain loop does no map-reduce: pick shorter "
                             "documents (--docs) or fewer --max-new-tokens")
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)
        summaries[path.name.lower()] = tokenizer.decode(output[0, prompt_tokens:], skip_special_tokens=True).strip()
    return PlainRun(load_s, time.perf_counter() - start, time.process_time() - cpu_start, summaries)


def model_folder(name: str, tmp: Path) -> Path | str:
    """The folder both sides load: the builtin's converted copy, tiny-random saved once, or `name` itself."""
    if name == BUILTIN_PREFIX + TINY_RANDOM:  # built from a seeded config: save it so both load the same files
        loaded = load_model(ModelConfig(name=name, dtype="float32", device="cpu"))
        folder = tmp / "tiny-random"
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
        return folder
    if name.startswith(BUILTIN_PREFIX):
        return builtin_model_dir(name)
    return name


def kvbatch_run(manifest: Path, job: Path, config: Path, overrides: list[str]) -> BatchRun:
    worker_cpu = WorkerCpu(job / "job.log")
    run = submit(manifest, config, job, overrides, watch=worker_cpu.sample)
    ended = run.started_at + run.wall_s
    batch_start, batch_end = run.first("batch_start")["ts"], run.first("batch_end")["ts"]
    load_s = max(e["load_s"] for e in run.ready)
    return BatchRun(
        wall_s=run.wall_s,
        startup_s=batch_start - run.started_at,
        worker_start_s=run.batch_started_at - batch_start - load_s,
        load_s=load_s,
        summarise_s=run.batch_s,
        finish_s=ended - batch_end,
        worker_cpu_s=worker_cpu.cpu_s,
        summaries=run.summaries,
        map_reduced={r["doc_id"]: r["chunks"] for r in run.rows if (r["chunks"] or 0) > 1},
    )


def print_table(model: str, n_docs: int, threads: int, plain: list[PlainRun], batch: BatchRun) -> None:
    def row(label: str, ours: float | None, *theirs: float | None) -> None:
        cell = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"
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
    print(f"ratio kvbatch / plain transformers (mean), summarise wall: {ratio:.3f} "
          f"({verdict} the {TARGET_RATIO:.2f} target); CPU: {batch.worker_cpu_s / plain_cpu_s:.3f}")
    print(f"identical summaries: {same}/{len(plain[0].summaries)}")
    for doc, chunks in batch.map_reduced.items():
        print(f"  {doc}: kvbatch summarised it in {chunks} chunks (map-reduce), the plain loop in one pass")
    for doc, text in plain[0].summaries.items():
        if batch.summaries.get(doc) != text:
            print(f"  {doc} differs:\n    kvbatch: {batch.summaries.get(doc)!r}\n    plain:   {text!r}")
    if plain[0].summaries != plain[-1].summaries:
        print("  (the two plain runs disagree with each other)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m", help="a builtin, a local folder or a cached hub id")
    parser.add_argument("--docs", nargs="+", default=DEFAULT_DOCS, help=f"names in {LICENSES}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the worker's cpus_per_worker)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    args = parser.parse_args()

    paths = [LICENSES / name for name in args.docs]
    with tempfile.TemporaryDirectory(prefix="kvbatch-bench-") as tmp:
        folder = model_folder(args.model, Path(tmp))
        kvbatch_model = str(folder) if args.model == BUILTIN_PREFIX + TINY_RANDOM else args.model
        overrides = [f"model.name={kvbatch_model}", f"model.device={args.device}", f"model.dtype={args.dtype}",
                     f"summarize.max_new_tokens={args.max_new_tokens}", "workers.count=1",
                     f"workers.cpus_per_worker={args.threads}"]
        cfg = load_config(args.config, overrides)
        settings = cfg.summarize
        if settings.do_sample:
            raise SystemExit(f"{args.config} samples (summarize.do_sample): the comparison needs greedy decoding")

        def plain() -> PlainRun:
            return plain_transformers(folder, paths, settings.prompt, settings.max_new_tokens, settings.context_tokens,
                                      args.device, getattr(torch, args.dtype), args.threads)

        manifest = write_manifest(Path(tmp) / "manifest.jsonl", [{"id": p.name.lower(), "path": str(p)} for p in paths])
        before = plain()
        batch = kvbatch_run(manifest, Path(tmp) / "job", args.config, overrides)
        after = plain()
    print_table(args.model, len(paths), args.threads, [before, after], batch)


if __name__ == "__main__":
    main()
