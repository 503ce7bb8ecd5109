"""The decode step on a device, side by side in one run (issue 36, 48): bench/device.sh's bench step.

A random Llama of Llama-3-8B's shape in bf16 (small shapes in fp32 on the CPU, a dry run), tokenizer-
free. Four sections, each with a time budget (`--budgets`; what a spent budget or `--deadline` leaves
unstarted is listed under `skipped`, with why), each row in its own guard (an error, a failed capture
or an OOM is that row's `error`, type and message; the next row runs):

- rows: for each shape (rows x prompt tokens, widest first: on CUDA 32 x 8,192, 32 x 2,048, 8 and 1 x
  8,192), one prefill, then `--decode-steps` steps of each way to decode them:
  `static-cache graph`: plain transformers, `StaticCache`, one decode step captured in a
  `torch.cuda.CUDAGraph` and replayed, the tokens left on the device (gpt-fast's way: the fastest a
  transformers user writes); eager on the CPU, where there are no graphs;
  `kvbatch graphed`: kvbatch's static step (runner/engine/static_step.py), replayed per bucket and span,
  the tokens read every step as the worker reads them; `kvbatch graphed, cuDNN off`: the same without
  SDPA's cuDNN backend (CUDA only); `kvbatch static eager`: the static step without graphs;
  `kvbatch pooled eager`: the pooled step as it ran before the static one (`mixed_step`).
  Each row: decode tok/s, its share of the memory-bandwidth bound (what a step must read, at the rate
  this device reads memory, measured first), x the static-cache graph's, host ms per step (the host's
  time to queue a step) and kernels per step (the profiler's CUDA kernels, or aten ops on the CPU).
- agreement: each row's tokens against the same prompts decoded one at a time (pooled alone, and on
  the per-row path): 100 % is the contract; where they differ, the first step that does, with the
  reference's logit margin there (a near-tie is rounding; a wide margin is a wrong op).
- job: the engine as the worker builds it (the default config, `batch.static_step: on`: n-gram ban,
  loop stop, riding prompts, the worker's KV pool plan) on `--job` documents arriving in turn (at most
  `batch.max_sequences` in flight, the next submitted as one ends): tok/s over its decode steps against
  the bound at its mean rows, and the share of row-steps the static step ran.
- offload: one long prompt streamed from host RAM (tiered-host) against transformers' `offloaded`, and
  against the bound the host link allows (its pinned copy rate, measured here).

The JSON report is rewritten after every row, so a stopped run keeps what finished.

Run: python bench/device_step.py --device cuda --report device.json
     python bench/device_step.py --device cpu   (a dry run: small shapes)
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from throughput import (
    DEVICE_SHAPES,
    _free,
    _sync,
    agreement,
    device_read_gbs,
    offload_rates,
    step_bytes,
    synthetic_llama,
    write_report,
)
from transformers import StaticCache

from jobs.attention import attention_path
from jobs.config import JobConfig, SummarizeConfig, load_config
from jobs.outcome import static_share
from runner.engine.batch_engine import BatchEngine, PassRequest, PassResult
from runner.engine.cache_recipe import CacheKit
from runner.engine.generation import prefill
from runner.engine.kvcache import BudgetedDynamicCache, ResidentMeter, kv_shape, resolve_budgets
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import LoadedModel
from runner.engine.ragged import decode_step
from runner.engine.sdpa import choose_sdpa
from runner.engine.static_step import StaticStep, bucket
from runner.engine.worker import _is_memory_error

STARTED = time.monotonic()
"""When this process began: the deadline counts from it (its model and imports included)."""
KVBATCH_WAYS = ("kvbatch graphed", "kvbatch graphed, cuDNN off", "kvbatch static eager", "kvbatch pooled eager")
BASELINE = "static-cache graph"
ALONE_PROMPTS = 4
"""Prompts decoded one at a time for the agreement rows (every width holds the first of them)."""
PREFILL_CHUNK = 2048
"""Prompt tokens per row the baseline's prefill takes a forward (kvbatch's rows are prefilled in these
chunks too). One forward of 32 x 8,192 tokens through Llama-3-8B in bf16 holds, beside the weights
(15 GiB) and the StaticCache (32 rows x 8,232 tokens x 128 KiB = 32.2 GiB), about 28 GiB of
activations: the hidden state (262,144 tokens x 4,096 x 2 B = 2 GiB, a few live at once), the MLP's
gate, up and their product (3 x 262,144 x 14,336 x 2 B = 21 GiB) and the 4-D mask SDPA is given
(32 x 8,192 x 8,232, up to 4.3 GB): about 75 GiB in all, over an H100's 78 GiB usable. In chunks of
2,048 the activations are a quarter (about 7 GiB), so the peak is about 55 GiB, on an H100 as on an
H200."""
SECTIONS = ("rows", "agreement", "job", "offload")
BUDGETS = {"cuda": {"rows": 100, "agreement": 20, "job": 70, "offload": 30},
           "cpu": {"rows": 240, "agreement": 60, "job": 120, "offload": 60}}
"""Seconds each section may start work in (`--budgets` overrides). On CUDA their sum and the model's
making (about 15 s) stay inside bench/device.sh's 250 s for the bench (docs/device.md)."""
JOB = {"cuda": "32x8192x120", "cpu": "24x1024x16"}
"""The job section's documents x context tokens x new tokens: on CUDA 32 documents of 8k, the default
summary length."""
SHORT_PROMPT = {"cuda": 2048, "cpu": 64}
"""The prompt of the extra widest shape: the issue's `within 1.2x of static-cache graph at 32 x 2k`."""


@dataclass
class Row:
    rows: int
    prompt_tokens: int
    way: str
    decode_tok_s: float
    host_ms_per_step: float
    kernels_per_step: int
    bound_tok_s: float = 0.0
    of_bound: float = 0.0
    x_baseline: float | None = None
    note: str = ""


Shape = tuple[int, int]
"""Rows a step, prompt tokens a row."""


class Budget:
    """When each section must stop starting work: its own seconds from its start, and the whole run's
    deadline (from the process's start). A row is started only while both leave time, so a cut run
    says what it skipped and why instead of losing what it had."""

    def __init__(self, deadline_s: float, seconds: dict[str, float]) -> None:
        self.deadline_s = deadline_s
        self.seconds = seconds
        self._began: dict[str, float] = {}

    def spent(self, section: str) -> str | None:
        """Why `section` may start no more work now (None: it may); its clock starts at the first ask."""
        now = time.monotonic()
        began = self._began.setdefault(section, now)
        if now - STARTED > self.deadline_s:
            return f"past the {self.deadline_s:.0f} s deadline"
        if now - began >= self.seconds[section]:  # a budget of 0 starts nothing
            return f"the {section} section's {self.seconds[section]:.0f} s budget spent"
        return None

    def left(self, section: str) -> float:
        """Seconds `section` may still run: the least of its budget's and the deadline's."""
        now = time.monotonic()
        began = self._began.setdefault(section, now)
        return max(0.0, min(self.seconds[section] - (now - began), self.deadline_s - (now - STARTED)))


def parse_budgets(device_type: str, given: str | None) -> dict[str, float]:
    """`section=seconds,...` over the device's defaults."""
    budgets = dict(BUDGETS[device_type])
    for item in filter(None, (given or "").split(",")):
        section, _, seconds = item.partition("=")
        if section not in budgets:
            raise SystemExit(f"--budgets: no section '{section}': use {', '.join(SECTIONS)}")
        budgets[section] = float(seconds)
    return budgets


def guarded(device: torch.device, what: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One bench row in its own guard: `what` names it, `measure` gives its figures. Any error (an OOM,
    a failed capture, a CUDA error) becomes the row's `error`, its type and message, and the bench goes
    on; the failed row's tensors are freed before the next (the traceback dies with the handler)."""
    try:
        return what | measure()
    except Exception as e:  # noqa: BLE001 - a row's failure is a figure of the run, never the run's end
        return what | {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        release(device)


def release(device: torch.device) -> None:
    """Free what the last row left. After a sticky CUDA error (an illegal address) the device refuses
    even this: the next rows then carry that error, and the bench still ends with its report."""
    with suppress(Exception):
        _free(device)


def device_order(shapes: list[Shape]) -> list[tuple[Shape, str]]:
    """The rows, widest first (the longest prompt first at a width) and the baseline before kvbatch's
    ways at each shape: the issue's figures (32 rows, graphed against the static-cache graph) come
    before a budget can cut the run."""
    return [(shape, way) for shape in sorted(shapes, reverse=True) for way in (BASELINE, *KVBATCH_WAYS)]


def count_kernels(device: torch.device, step: Callable[[], object]) -> int:
    """Kernels one call of `step` launches (aten ops on the CPU), counted by the profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        _sync(device)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset")))
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@contextmanager
def cudnn_sdpa(enabled: bool):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


class PooledPrompts:
    """The prompts prefilled once into a KV pool; `restart` takes every row back to its prompt, so each
    way decodes the same steps from the same state (a step only writes past the prompt)."""

    def __init__(self, loaded: LoadedModel, prompts: list[list[int]], steps: int) -> None:
        self.loaded = loaded
        length = len(prompts[0])
        self.pool = KVPool.for_model(loaded.model.config, loaded.dtype, loaded.device,
                                     ResidentMeter(None, "the bench's device", ""),
                                     planned=(bucket(len(prompts)), length + steps + 8))
        self.caches = [PooledCache(self.pool, length + steps + 8) for _ in prompts]
        settings = SummarizeConfig(prefill_chunk_size=PREFILL_CHUNK)
        self.firsts = [int(prefill(loaded, ids, settings, cache, "auto").argmax()) for ids, cache in
                       zip(prompts, self.caches)]
        self.length = length

    def restart(self) -> None:
        for cache in self.caches:
            cache.length = self.length

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


def decode(device: torch.device, firsts: list[int], steps: int, step: Callable[[list[int]], torch.Tensor],
           restart: Callable[[], None]) -> tuple[float, float, int, list[list[int]]]:
    """tok/s, host ms a step and kernels a step of `step` (last tokens in, [rows] tokens on the device out,
    read every step), and each row's tokens: two untimed steps first (a graph's capture), then `steps`."""
    for _ in range(2):
        step(list(firsts)).tolist()
    restart()
    kernels = count_kernels(device, lambda: step(list(firsts)).tolist())
    restart()
    out = [[t] for t in firsts]
    host = 0.0
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        queued = time.perf_counter()
        tokens = step([row[-1] for row in out])
        host += time.perf_counter() - queued
        for row, token in zip(out, tokens.tolist()):
            row.append(token)
    _sync(device)
    elapsed = time.perf_counter() - started
    return len(firsts) * steps / elapsed, 1000 * host / steps, kernels, out


def kvbatch_way(loaded: LoadedModel, pooled: PooledPrompts, way: str, steps: int
                ) -> tuple[float, float, int, list[list[int]]]:
    caches = pooled.caches
    if way == "kvbatch pooled eager":
        def step(last: list[int]) -> torch.Tensor:
            return decode_step(loaded.model, last, [c.length for c in caches], caches).argmax(-1)
    else:
        static = StaticStep(loaded.model, pooled.pool,
                            graphs=way.startswith("kvbatch graphed") and loaded.device.type == "cuda")

        def step(last: list[int]) -> torch.Tensor:
            return static.run(last, caches)[1]
    pooled.restart()
    try:
        with cudnn_sdpa(not way.endswith("cuDNN off")) if loaded.device.type == "cuda" else nullcontext():
            return decode(loaded.device, pooled.firsts, steps, step, pooled.restart)
    finally:
        pooled.restart()


def chunked_prefill(model: torch.nn.Module, ids: torch.Tensor, cache: StaticCache) -> torch.Tensor:
    """`ids` ([rows, tokens]) into `cache` in forwards of PREFILL_CHUNK tokens a row (the positions
    given, as transformers' static cache takes them): the last position's logits, [rows, vocab]."""
    for start in range(0, ids.shape[1], PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, ids.shape[1])
        out = model(input_ids=ids[:, start:end], cache_position=torch.arange(start, end, device=ids.device),
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def static_cache_graph(loaded: LoadedModel, prompts: list[list[int]], steps: int
                       ) -> tuple[float, float, int, list[list[int]], str]:
    """Plain transformers: StaticCache, the prompts prefilled together (in chunks: PREFILL_CHUNK), one
    decode step captured in a CUDA graph (the ids fed back and the position advanced inside it) and
    replayed `steps` times, the tokens kept on the device until the end. tok/s, host ms a step,
    kernels a step, tokens, a note."""
    model, device = loaded.model, loaded.device
    length = len(prompts[0])
    cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
    with torch.inference_mode():
        ids = chunked_prefill(model, torch.tensor(prompts, device=device), cache).argmax(-1, keepdim=True)  # [rows, 1]
        position = torch.tensor([length], device=device)
        kept = [ids.clone()]

        def step() -> None:
            logits = model(input_ids=ids, cache_position=position, past_key_values=cache, use_cache=True).logits
            ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
            position.add_(1)

        run, note = step, "eager (no CUDA graphs on the CPU)"
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up steps are real steps: their tokens count
                    step()
                    kept.append(ids.clone())
            torch.cuda.current_stream(device).wait_stream(side)
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                run, note = graph.replay, "one captured CUDA graph"
            except RuntimeError as e:  # the baseline is reported eager, with why
                run, note = step, f"eager: capture failed: {str(e)[:200]}"
                torch.cuda.synchronize(device)
        kernels = count_kernels(device, run)
        kept.append(ids.clone())
        host = 0.0
        _sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            queued = time.perf_counter()
            run()
            kept.append(ids.clone())
            host += time.perf_counter() - queued
        _sync(device)
        elapsed = time.perf_counter() - started
    tokens = torch.cat(kept, dim=1).tolist()
    return len(prompts) * steps / elapsed, 1000 * host / steps, kernels, tokens, note


@dataclass
class Alone:
    """The first prompts decoded one at a time: the agreement rows' references."""

    tokens: dict[str, list[list[int]]]
    """"pooled alone" and "per-row alone": each prompt's tokens."""
    margins: list[list[float]]
    """The per-row path's logit margin (top token's over the next) at each step of each prompt: how
    near a tie the reference was where a way's token differs."""


def alone_tokens(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> Alone:
    """The first prompts decoded one at a time, pooled (a pool of one) and on the per-row path."""
    got = Alone({"pooled alone": [], "per-row alone": []}, [])
    for ids in prompts[:ALONE_PROMPTS]:
        pooled = PooledPrompts(loaded, [ids], steps)
        got.tokens["pooled alone"].append(kvbatch_way(loaded, pooled, "kvbatch static eager", steps)[3][0])
        pooled.close()
        cache = BudgetedDynamicCache(loaded.model.config, None, len(ids) + steps + 8)
        logits = prefill(loaded, ids, SummarizeConfig(prefill_chunk_size=PREFILL_CHUNK), cache, "auto")
        out, margins = [], []
        for _ in range(steps + 1):
            top = logits[0].float().topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if len(out) <= steps:
                logits = decode_step(loaded.model, [out[-1]], [cache.get_seq_length()], [cache])
        got.tokens["per-row alone"].append(out)
        got.margins.append(margins)
        _free(loaded.device)
    return got


def first_difference(tokens: list[list[int]], reference: list[list[int]], margins: list[list[float]]
                     ) -> dict[str, Any] | None:
    """Where `tokens` first part from `reference` (the earliest step over the prompts), with the
    reference's margin there: None when they agree."""
    firsts = [(step, prompt) for prompt, (ours, ref) in enumerate(zip(tokens, reference))
              for step, (a, b) in enumerate(zip(ours, ref)) if a != b]
    if not firsts:
        return None
    step, prompt = min(firsts)
    return {"prompt": prompt, "step": step, "token": tokens[prompt][step], "reference": reference[prompt][step],
            "reference_margin": margins[prompt][step]}


class TimedEngine(BatchEngine):
    """The worker's engine, timing its decode steps: a step ends with its tokens read on the host, so
    the wall time of `_decode` is the step's (a riding prompt chunk's work included)."""

    decode_s = 0.0

    def _decode(self, *args: Any) -> None:
        started = time.perf_counter()
        try:
            super()._decode(*args)
        finally:
            self.decode_s += time.perf_counter() - started


def job_config(tokens: int, new_tokens: int) -> JobConfig:
    """The default config for passes of `tokens` context, with the static step on (on the CPU it runs
    the same step eagerly; `auto` is on with CUDA)."""
    return load_config(None, ["batch.static_step=on", f"summarize.context_tokens={tokens}",
                              f"summarize.min_context_tokens={min(tokens, 1024)}",
                              f"summarize.max_new_tokens={new_tokens}"])


def worker_engine(loaded: LoadedModel, config: JobConfig) -> tuple[TimedEngine, StaticStep, CacheKit]:
    """The engine as SummaryWorker builds it from `config` (runner/engine/worker.py: its budgets, its KV
    pool planned for the batch at the whole context on CUDA, its cache kit, its static step), around a
    model made here: the worker loads its model by name, and an 8B-shaped one saved and loaded back
    would cost the device run a minute."""
    device = loaded.device
    device_budget, host_budget = resolve_budgets(config.cache, device)
    device_meter = ResidentMeter(device_budget, "the batch's resident device", "cache.device_kv_budget_bytes")
    host_meter = ResidentMeter(host_budget, "the batch's host RAM", "cache.host_kv_budget_bytes")
    shape = kv_shape(loaded.model.config, loaded.dtype)
    assert attention_path(config.batch.attention, device.type, False) == "pooled", "the job row runs the pooled path"
    sequences = config.batch.sequences
    plan = (bucket(sequences), config.summarize.context_tokens) if device.type == "cuda" else None
    pool = KVPool.for_model(loaded.model.config, loaded.dtype, device, device_meter, plan)
    kit = CacheKit(loaded.model, config.cache, shape, device_budget, host_budget, device_meter, host_meter, pool,
                   device_is_cpu=device.type == "cpu")
    pieces = loaded.word_pieces if config.summarize.no_repeat_summary_ngram else None
    static = StaticStep(loaded.model, pool, graphs=device.type == "cuda", pieces=pieces)
    choose_sdpa(config.batch.sdpa_backend, device)
    pool.reserve()  # the worker's start: the pool made for its life, every decode step captured
    static.capture_all(sequences)
    engine = TimedEngine(loaded, config.summarize, config.cache.prefill, sequences, device_budget, _is_memory_error,
                         host_budget=host_budget, prefill_chunk_tokens=config.batch.prefill_chunk_tokens, static=static)
    return engine, static, kit


def real_job(loaded: LoadedModel, spec: str, read_gbs: float, seconds: float) -> dict[str, Any]:
    """`spec` (documents x context tokens x new tokens) through the worker's engine, the documents
    arriving in turn as a worker's tasks do (at most `batch.max_sequences` in flight, the next one
    submitted as one ends); stopped after `seconds` with what ran (the rest fail with the closed engine).
    Decode tok/s is the decode steps' row-steps over their wall time (riding chunks included), against
    the bound of a step of the job's mean rows at the prompts' length plus half the summary; the static
    share is the engine's row-steps through the static step over all (the eager ones by why), and the
    least of the documents' own (each result row's `static_step_share`)."""
    documents, tokens, new_tokens = (int(n) for n in spec.split("x"))
    config = job_config(tokens, new_tokens)
    engine, static, kit = worker_engine(loaded, config)
    prompt_tokens = tokens - new_tokens  # a document that fills its pass's context
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, loaded.model.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
               for _ in range(documents)]
    recipe = kit.recipe("dynamic", tokens, None)  # the ladder's first rung: every pass fits the device budget
    done: list[PassResult] = []
    failed: Counter[str] = Counter()
    started = time.perf_counter()
    try:
        in_flight: set[Future[PassResult]] = set()
        queue = list(prompts)
        while queue or in_flight:
            while queue and len(in_flight) < config.batch.sequences:
                in_flight.add(engine.submit(PassRequest(queue.pop(0), new_tokens, recipe, recipe.device_bytes,
                                                        recipe.host_bytes)))
            left = seconds - (time.perf_counter() - started)
            finished, in_flight = wait(in_flight, timeout=max(left, 0.0), return_when=FIRST_COMPLETED)
            for future in finished:
                if future.exception() is None:
                    done.append(future.result())
                else:
                    failed[type(future.exception()).__name__] += 1
            if left <= 0 and not finished:
                break
    finally:
        engine.close()
    job_s = time.perf_counter() - started
    plan = engine.plan
    new = sum(len(r.generation.tokens) for r in done)
    shares = [share for r in done if (share := static_share(r.decode_steps)) is not None]
    mean_rows = plan.tokens_decoded / plan.decode_steps if plan.decode_steps else 0.0
    decode_tok_s = plan.tokens_decoded / engine.decode_s if engine.decode_s else 0.0
    bound = (mean_rows * read_gbs * 1e9 / step_bytes(loaded, mean_rows, prompt_tokens + new_tokens // 2)
             if mean_rows else 0.0)
    note = "" if len(done) == documents else f"stopped after {seconds:.0f} s: {len(done)} of {documents} documents done"
    return {"documents": documents, "context_tokens": tokens, "new_tokens": new_tokens,
            "max_sequences": config.batch.sequences, "done": len(done), "failed": dict(failed),
            "stop_reasons": dict(Counter(str(r.generation.stop_reason) for r in done)),
            "job_s": job_s, "job_tok_s": new / job_s, "decode_steps": plan.decode_steps,
            "row_steps": plan.tokens_decoded, "steps_with_prefill": plan.steps_with_prefill, "mean_rows": mean_rows,
            "decode_s": engine.decode_s, "decode_tok_s": decode_tok_s, "bound_tok_s": bound,
            "of_bound": decode_tok_s / bound if bound else 0.0, "static_steps": static.steps,
            "static_row_steps": plan.static_row_steps, "eager_row_steps": dict(plan.eager_row_steps),
            "ahead_row_steps": static.ahead_row_steps,
            "static_share": plan.static_row_steps / plan.tokens_decoded if plan.tokens_decoded else 0.0,
            "least_document_share": min(shares, default=None), "captures": static.captures,
            "replays": static.replays, "failed_captures": static.failed_captures, "note": note}


def pinned_copy_gbs(device: torch.device, nbytes: int) -> float:
    """How fast pinned host memory reaches the device: what bounds a layer streamed from host RAM."""
    if device.type != "cuda":
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(3):
        target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - started) / 1e9


class Bench:
    """One run's model, prompts, report and budgets, section by section."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        fields, prompt_tokens, rows_spec, offload_tokens = DEVICE_SHAPES[self.device.type]
        self.offload_tokens = args.offload_tokens or offload_tokens
        prompt_tokens = args.prompt_tokens or prompt_tokens
        widths = [int(w) for w in (args.rows or rows_spec).split(",")]
        short = SHORT_PROMPT[self.device.type] if args.short_prompt_tokens is None else args.short_prompt_tokens
        self.shapes: list[Shape] = [(w, prompt_tokens) for w in widths] + (
            [(max(widths), short)] if 0 < short < prompt_tokens else [])
        self.steps = args.decode_steps
        self.job_spec = args.job or JOB[self.device.type]
        self.fault_way = args.fault_way
        self.out = args.report
        self.budget = Budget(args.deadline, parse_budgets(self.device.type, args.budgets))
        self.loaded = synthetic_llama(self.device, fields)
        self.read_gbs = device_read_gbs(self.device, 4 << 30 if self.device.type == "cuda" else 256 << 20)
        generator = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(3, fields["vocab_size"], (prompt_tokens,), generator=generator).tolist()
                        for _ in range(max(widths))]
        self.report: dict[str, Any] = {
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "model": self.loaded.name, "prompt_tokens": prompt_tokens, "decode_steps": self.steps,
            "read_gbs": self.read_gbs, "deadline_s": args.deadline, "budgets_s": self.budget.seconds,
            "rows": [], "agreement": [], "job": None, "offload": [], "skipped": []}
        self.tokens_of: dict[tuple[Shape, str], list[list[int]]] = {}

    def write(self) -> None:
        write_report(self.out, self.report)

    def skip(self, section: str, why: str, **what: Any) -> None:
        self.report["skipped"].append({"section": section, **what, "why": why})
        self.write()
        print(f"{section}{''.join(f' {v}' for v in what.values())} skipped: {why}", flush=True)

    def prompts_of(self, shape: Shape) -> list[list[int]]:
        rows, tokens = shape
        return [ids[:tokens] for ids in self.prompts[:rows]]

    # -- rows ----------------------------------------------------------------------------------------
    def rows(self) -> None:
        print(f"{'rows':>4} {'tokens':>6} {'way':<27} {'tok/s':>9} {'of bound':>8} {'x graph':>7} {'host ms':>8} "
              f"{'kernels':>7}  note")
        baseline: dict[Shape, float] = {}
        pooled: dict[Shape, PooledPrompts] = {}
        for shape, way in device_order(self.shapes):
            if way.endswith("cuDNN off") and self.device.type != "cuda":
                continue
            what = {"rows": shape[0], "prompt_tokens": shape[1], "way": way}
            why = self.budget.spent("rows")
            if why is not None:
                self.skip("rows", why, **what)
                continue
            if way == BASELINE:  # each shape's pool goes before the next shape's baseline
                for prompts in pooled.values():
                    prompts.close()
                pooled.clear()
            row = guarded(self.device, what, lambda: self.measure(shape, way, pooled, baseline))
            self.report["rows"].append(row)
            self.write()
            print(row_line(row), flush=True)
        for prompts in pooled.values():
            prompts.close()
        release(self.device)

    def measure(self, shape: Shape, way: str, pooled: dict[Shape, PooledPrompts], baseline: dict[Shape, float]
                ) -> dict[str, Any]:
        """One way at one shape: its Row's figures (its tokens kept for the agreement rows)."""
        if way == self.fault_way:  # the rehearsal of a failed row: a real allocator error's type
            raise torch.OutOfMemoryError(f"injected by --fault-way '{way}'")
        width, tokens = shape
        if way == BASELINE:
            rate, host_ms, kernels, self.tokens_of[shape, way], note = static_cache_graph(
                self.loaded, self.prompts_of(shape), self.steps)
            baseline[shape] = rate
        else:
            if shape not in pooled:
                pooled[shape] = PooledPrompts(self.loaded, self.prompts_of(shape), self.steps)
            rate, host_ms, kernels, self.tokens_of[shape, way] = kvbatch_way(self.loaded, pooled[shape], way,
                                                                              self.steps)
            eager = way == "kvbatch graphed" and self.device.type != "cuda"
            note = "eager (no CUDA graphs on the CPU)" if eager else ""
        bound = width * self.read_gbs * 1e9 / step_bytes(self.loaded, width, tokens + self.steps // 2)
        row = Row(width, tokens, way, rate, host_ms, kernels, bound, rate / bound,
                  rate / baseline[shape] if shape in baseline else None, note)
        return asdict(row)

    # -- agreement -----------------------------------------------------------------------------------
    def agreement(self) -> None:
        why = self.budget.spent("agreement")
        if why is not None:
            self.skip("agreement", why)
            return
        print(f"{'rows':>4} {'tokens':>6} {'way':<27} {'= pooled alone':>14} {'= per-row alone':>15}  first difference")
        alone: dict[int, dict[str, Any]] = {}  # prompt tokens -> {'alone': Alone} or {'error': ...}
        for (shape, way), tokens in self.tokens_of.items():
            width, length = shape
            what = {"rows": width, "prompt_tokens": length, "way": way}
            why = self.budget.spent("agreement")
            if why is not None:
                self.skip("agreement", why, **what)
                continue
            if length not in alone:
                alone[length] = guarded(self.device, {}, lambda: {"alone": alone_tokens(
                    self.loaded, [ids[:length] for ids in self.prompts], self.steps)})
            reference = alone[length]
            row = what | ({"error": f"the alone references: {reference['error']}"} if "error" in reference
                          else compare(tokens, reference["alone"]))
            self.report["agreement"].append(row)
            self.write()
            print(agreement_line(row), flush=True)

    # -- job -----------------------------------------------------------------------------------------
    def job(self) -> None:
        why = self.budget.spent("job")
        if why is not None:
            self.skip("job", why, job=self.job_spec)
            return
        self.report["job"] = row = guarded(self.device, {"job": self.job_spec}, lambda: real_job(
            self.loaded, self.job_spec, self.read_gbs, self.budget.left("job")))
        self.write()
        print(job_line(row), flush=True)

    # -- offload -------------------------------------------------------------------------------------
    def offload(self) -> None:
        why = self.budget.spent("offload")
        if why is not None:
            self.skip("offload", why, prompt_tokens=self.offload_tokens)
            return
        row = guarded(self.device, {"prompt_tokens": self.offload_tokens}, self.offload_rows)
        if "error" in row:
            self.report["offload"].append(row)
            print(f"{self.offload_tokens}-token prompt streamed from host RAM: {row['error']}", flush=True)
        self.write()

    def offload_rows(self) -> dict[str, Any]:
        link_gbs = pinned_copy_gbs(self.device, 1 << 30)
        kv_step = step_bytes(self.loaded, 1, self.offload_tokens) - step_bytes(self.loaded, 0, self.offload_tokens)
        self.report["pinned_copy_gbs"] = link_gbs
        for row in offload_rates(self.loaded, self.offload_tokens, 16):
            row["link_bound_tok_s"] = link_gbs * 1e9 / kv_step if link_gbs else None
            self.report["offload"].append(row)
            share = (f", {row['decode_tok_s'] / row['link_bound_tok_s']:.0%} of the host link's bound (pinned copies "
                     f"at {link_gbs:.1f} GB/s)") if link_gbs else ""
            print(f"{row['prompt_tokens']}-token prompt, {row['cache']:<12}: prefill {row['prefill_s']:6.1f} s, "
                  f"decode {row['decode_tok_s']:7.2f} tok/s{share}", flush=True)
        return {}


def compare(tokens: list[list[int]], alone: Alone) -> dict[str, Any]:
    """A way's tokens against each alone reference, over the prompts both have."""
    count = min(len(tokens), ALONE_PROMPTS)
    row: dict[str, Any] = {}
    for name, reference in alone.tokens.items():
        key = name.replace(" ", "_")
        row[f"same_as_{key}"] = agreement(tokens[:count], reference[:count])
        row[f"first_difference_from_{key}"] = first_difference(tokens[:count], reference[:count], alone.margins)
    return row


def row_line(row: dict[str, Any]) -> str:
    head = f"{row['rows']:>4} {row['prompt_tokens']:>6} {row['way']:<27}"
    if "error" in row:
        return f"{head} error: {row['error']}"
    versus = f"{row['x_baseline']:>7.2f}" if row["x_baseline"] is not None else f"{'n/a':>7}"
    return (f"{head} {row['decode_tok_s']:>9.1f} {row['of_bound']:>8.1%} {versus} {row['host_ms_per_step']:>8.2f} "
            f"{row['kernels_per_step']:>7}  {row['note']}")


def agreement_line(row: dict[str, Any]) -> str:
    head = f"{row['rows']:>4} {row['prompt_tokens']:>6} {row['way']:<27}"
    if "error" in row:
        return f"{head} error: {row['error']}"
    differs = [f"{name.removeprefix('first_difference_from_')}: prompt {d['prompt']} step {d['step']} "
               f"({d['token']} for {d['reference']}, reference margin {d['reference_margin']:.3g})"
               for name, d in row.items() if name.startswith("first_difference_from_") and d is not None]
    return (f"{head} {row['same_as_pooled_alone']:>14.1%} {row['same_as_per-row_alone']:>15.1%}  "
            f"{'; '.join(differs) or '-'}")


def job_line(row: dict[str, Any]) -> str:
    head = f"real job {row['job']} (documents x context x new tokens)"
    if "error" in row:
        return f"{head}: error: {row['error']}"
    return (f"{head}: {row['done']} done in {row['job_s']:.1f} s ({row['job_tok_s']:.1f} new tok/s overall); decode "
            f"{row['decode_tok_s']:.1f} tok/s = {row['of_bound']:.1%} of the bound at {row['mean_rows']:.1f} rows; "
            f"{row['static_share']:.1%} of {row['row_steps']} row-steps on the static step (the least of a "
            f"document's {row['least_document_share'] or 0:.1%}; eager: {row['eager_row_steps'] or 'none'}; "
            f"{row['static_steps']} steps, {row['ahead_row_steps']} row-steps launched ahead of the last read, "
            f"{row['captures']} captures, {row['replays']} replays, "
            f"{row['failed_captures']} failed), {row['steps_with_prefill']} of "
            f"{row['decode_steps']} steps with a riding chunk; stops {row['stop_reasons']}"
            f"{'; ' + row['note'] if row['note'] else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", help="rows per decode step (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (8192 on CUDA, 256 on the CPU)")
    parser.add_argument("--short-prompt-tokens", type=int,
                        help="one more shape at the most rows with prompts this long "
                             "(2048 on CUDA, 64 on the CPU; 0: none)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--job", help="the job row's documents x context tokens x new tokens "
                                      f"({JOB['cuda']} on CUDA, {JOB['cpu']} on the CPU)")
    parser.add_argument("--offload-tokens", type=int, help="the long prompt streamed from host RAM")
    parser.add_argument("--report", type=Path, help="also write the figures to this JSON file (after every row)")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds from the start after which nothing more is started")
    parser.add_argument("--budgets", help="section=seconds,... each section may start work in "
                                          f"(sections {', '.join(SECTIONS)}; defaults {BUDGETS})")
    parser.add_argument("--fault-way", help="rehearse a failed row: this way raises an OutOfMemoryError at every shape")
    bench = Bench(parser.parse_args())
    print(f"{bench.loaded.name} on {bench.report['device']}, shapes {bench.shapes} (rows x prompt tokens), "
          f"{bench.steps} decode steps; memory read at {bench.read_gbs:.0f} GB/s; budgets {bench.budget.seconds} s, "
          f"nothing started {bench.budget.deadline_s:.0f} s in", flush=True)
    bench.rows()
    bench.agreement()
    bench.job()
    bench.offload()


if __name__ == "__main__":
    main()
