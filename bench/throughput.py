"""Batching in the worker: documents per hour and decode tokens/s by `batch.max_sequences`, side by side.

Sections (all in one run, so the ratios share the machine's state):
- docs: 16 real documents (licence texts cut to 500-1,800 tokens, plus two of 4,000 and 6,000 that
  need map-reduce at context_tokens=2048), 120 new tokens, SmolLM2-135M fp32, through the real
  `kvbatch submit` on one local Ray, for max_sequences 1, 2, 4, 8, 16 and two layouts of the two
  cores: 2 workers x 1 thread and 1 worker x 2 threads. Docs/hour and output tokens/s are taken
  over the batch phase (last worker ready -> batch_end in job.log, bench/common.py), and every
  summary is compared with the same layout's max_sequences=1 run.
- anchors: what a user writes without kvbatch, on the same documents (the two long ones cut to fit
  the context, as a plain loop must): a batch-1 `model.generate` loop (transformers' default cache),
  and transformers' own continuous batching (`generate_batch`), with the share of documents whose
  tokens equal the loop's.
- decode: decode tokens/s of kvbatch's batched decode step alone, 16 prompts of ~500 tokens and 8 of
  ~1,060 and of ~3,000 tokens, one at a time vs together (prefill excluded), on each attention path
  (`batch.attention`: per-row, pooled), and whether the tokens agree with one at a time; beside
  plain `model.generate` one prompt at a time; then where a step's time goes at 3,000 tokens (weight
  matmuls, attention, the rest) and how fast attention reads the KV against a plain read of memory.
  The same step against the code before issue 21 (88824c8), and pooled against per-row on a
  mixed-length batch, side by side in one run: bench/decode_revisions.py.
- step-ops: what one decode step and its token choice cost the host (aten ops, kernel-launching ops,
  host ms, host syncs) at 1, 8 and 32 rows of a model with Llama-3-8B's attention shape, per-row and
  pooled (bench/step_ops.py).
- mix and cli-step (`--sections mix,cli-step`, by name only): 13 real documents
  of 400-4,000 tokens (some map-reduced at context 2048) with max_sequences=1 and batched, docs/hour
  and where the workers' decode time went (prefill, decode steps, rows stalled behind another's
  prefill, mean batch); and ~28 short sequences of step-ops' model through the CLI with the pooled
  path: each one's decode tok/s alone and in one batch.
- rides (`--sections rides`, by name only): a long prompt joining 4 decoding rows, prefilled whole or
  riding the decode steps in chunks: the decoders' longest wait, its TTFT, the batch's wall time.
- device-quant (`--sections device-quant`): decode tok/s and weight memory under each
  `model.quantization` the machine can run, the same random checkpoint loaded through kvbatch's loader.
- the decode step on a device (the static-cache graph baseline, kvbatch graphed and eager, agreement,
  tiered-host against the host link): bench/device_step.py.

Run: python bench/throughput.py [--sections docs,anchors,decode,step-ops] [--sequences 1,2,4,8,16]
     [--layouts 2x1,1x2] [--decode-shapes 500x16,3000x8] [--attention per-row,pooled] [--json]
     [--set KEY=VALUE ...] [--mix-sequences 1,auto] [--step-rows 28] [--rides-long 1536]
     [--sections device-quant --device cuda --report quant.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for common.py and step_ops.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from common import LICENSES, REPO, JobRun, Unfinished, decoded_tokens, local_ray, submit, write_manifest
from step_ops import shaped_model, step_ops
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

from jobs.config import ModelConfig, SummarizeConfig, load_config
from runner.engine.generation import TokenClock, prefill
from runner.engine.kvcache import BudgetedDynamicCache, ResidentMeter, TieredCache
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import LoadedModel, load_model
from runner.engine.model_registry import word_tokenizer
from runner.engine.ragged import decode_step
from storage.checkpoint import load_state

# (file, tokens): 14 documents that fit one pass at context 2048, and two that need map-reduce
DOCUMENTS = [("BSD", 500), ("CC0-1.0", 1500), ("Artistic", 1300), ("LGPL-3", 1650), ("Apache-2.0", 1800),
             ("GPL-1", 1700), ("MPL-2.0", 1400), ("GPL-2", 1200), ("LGPL-2.1", 1000), ("GFDL-1.2", 900),
             ("GFDL-1.3", 800), ("MPL-1.1", 700), ("LGPL-2", 600), ("GPL-3", 500), ("GPL-3", 6000),
             ("LGPL-2.1", 4000)]
NEW_TOKENS = 120
CONTEXT = 2048


@dataclass
class DocsRun:
    layout: str
    sequences: int
    run: JobRun

    @property
    def docs_per_hour(self) -> float:
        return self.run.docs_per_hour


def documents(loaded: LoadedModel) -> list[dict[str, str]]:
    """Real texts cut to their token length (BSD is short: it is repeated to reach its length)."""
    rows = []
    for i, (name, tokens) in enumerate(DOCUMENTS):
        ids: list[int] = []
        text = (LICENSES / name).read_text(encoding="utf-8")
        while len(ids) < tokens:
            ids += loaded.tokenizer(text, add_special_tokens=False).input_ids
        rows.append({"id": f"{i:02d}-{name.lower()}", "text": loaded.tokenizer.decode(ids[:tokens])})
    return rows


# -- docs: the real CLI ----------------------------------------------------------------------------
def run_kvbatch(manifest: Path, address: str, workdir: Path, layout: str, sequences: int, extra: list[str]
                ) -> DocsRun:
    workers, threads = (int(x) for x in layout.split("x"))
    settings = [f"summarize.max_new_tokens={NEW_TOKENS}", f"summarize.context_tokens={CONTEXT}",
                "summarize.min_context_tokens=1024", "model.dtype=float32", f"batch.max_sequences={sequences}",
                f"workers.count={workers}", f"workers.cpus_per_worker={threads}", *extra]
    job = workdir / f"job-{layout}-{sequences}"
    return DocsRun(layout, sequences, submit(manifest, REPO / "configs/default.yaml", job, settings, address))


def docs_section(loaded: LoadedModel, args: argparse.Namespace) -> None:
    runs: list[DocsRun] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-throughput-") as tmp, local_ray(2) as address:
        manifest = write_manifest(Path(tmp) / "docs.jsonl", documents(loaded))
        for layout in args.layouts.split(","):
            for sequences in (int(s) for s in args.sequences.split(",")):
                run = run_kvbatch(manifest, address, Path(tmp), layout, sequences, args.set)
                runs.append(run)
                print(f"  {layout} (workers x threads), max_sequences {sequences}: {run.docs_per_hour:.0f} docs/h",
                      flush=True)
    print(f"\n{'layout':>7} {'max_seq':>7} {'batch s':>8} {'docs/h':>7} {'x seq=1':>7} {'out tok/s':>9} "
          f"{'mean batch':>10} {'same':>5}")
    for run in runs:
        base = next(r for r in runs if r.layout == run.layout and r.sequences == min(
            x.sequences for x in runs if x.layout == run.layout))
        job, same = run.run, run.run.summaries == base.run.summaries
        print(f"{run.layout:>7} {run.sequences:>7} {job.batch_s:>8.1f} {run.docs_per_hour:>7.0f} "
              f"{run.docs_per_hour / base.docs_per_hour:>7.2f} "
              f"{sum(r['output_tokens'] for r in job.rows) / job.batch_s:>9.1f} {job.mean_batch:>10.2f} {same!s:>5}")
    best = max(runs, key=lambda r: r.docs_per_hour)
    print(f"\nbest: {best.layout} with max_sequences {best.sequences}; summaries identical across every run: "
          f"{all(r.run.summaries == runs[0].run.summaries for r in runs)}")


# -- anchors: plain transformers -------------------------------------------------------------------
def plain_prompts(loaded: LoadedModel, rows: list[dict[str, str]]) -> list[list[int]]:
    """What a plain loop sends: the chat template around the document, cut to fit the context."""
    cfg = load_config(REPO / "configs/default.yaml")
    prompts = []
    for row in rows:
        ids = loaded.tokenizer(row["text"], add_special_tokens=False).input_ids
        keep = CONTEXT - NEW_TOKENS - 64
        text = loaded.tokenizer.decode(ids[:keep])
        prompts.append(list(loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{cfg.summarize.prompt}\n\n{text}"}], add_generation_prompt=True,
            tokenize=True, return_dict=False)))
    return prompts


def plain_generate(loaded: LoadedModel, ids: list[int], **kwargs: int) -> tuple[list[int], float]:
    """What a user writes without kvbatch: greedy `model.generate` of one prompt with transformers' default
    cache. Its new tokens, and its decode seconds (from the first new token on, so prefill excluded)."""
    clock = TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id,
                                    streamer=clock, **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - (clock.first_token_at or t0)


def anchors_section(loaded: LoadedModel, args: argparse.Namespace) -> None:
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = plain_prompts(loaded, documents(loaded))
    loop_tokens, decode_s, decoded = [], 0.0, 0
    start = time.perf_counter()
    for ids in prompts:
        new, seconds = plain_generate(loaded, ids, max_new_tokens=NEW_TOKENS)
        loop_tokens.append(new)
        decode_s += seconds
        decoded += max(len(new) - 1, 0)
    loop_s = time.perf_counter() - start
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=model.generation_config.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    with torch.no_grad():  # its generation thread makes tensors outside inference mode, which then refuses them
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    batch_s = time.perf_counter() - start
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in outputs.values()}
    agree = sum(by_prompt.get(tuple(p)) == t for p, t in zip(prompts, loop_tokens))
    n, out_tokens = len(prompts), sum(len(t) for t in loop_tokens)
    print(f"{'anchor':<36} {'s':>7} {'docs/h':>7} {'out tok/s':>9} {'decode tok/s':>12}")
    print(f"{'plain generate loop, batch 1':<36} {loop_s:>7.1f} {n / loop_s * 3600:>7.0f} {out_tokens / loop_s:>9.1f} "
          f"{decoded / decode_s:>12.1f}")
    print(f"{'transformers generate_batch':<36} {batch_s:>7.1f} {n / batch_s * 3600:>7.0f} "
          f"{sum(len(t) for t in by_prompt.values()) / batch_s:>9.1f} {'n/a':>12}")
    print(f"generate_batch tokens equal to the loop's for {agree}/{n} documents")


# -- decode: the batched step alone ----------------------------------------------------------------
def _prefilled(loaded: LoadedModel, prompts: list[list[int]], tier: str | None, attention: str = "per-row"
               ) -> tuple[list, list[int]]:
    settings = SummarizeConfig(prefill_chunk_size=512)
    caches, first = [], []
    pool = (KVPool.for_model(loaded.model.config, loaded.dtype, loaded.device, ResidentMeter(None, "device", ""))
            if attention == "pooled" else None)
    for ids in prompts:
        cache = (TieredCache(loaded.model.config, tier=tier) if tier is not None
                 else PooledCache(pool, len(ids) + 64) if attention == "pooled"
                 else BudgetedDynamicCache(loaded.model.config, None, len(ids) + 64))
        first.append(int(prefill(loaded, ids, settings, cache, "auto").argmax()))
        caches.append(cache)
    return caches, first


def _greedy_step(loaded: LoadedModel, group: list[int], out: list[list[int]], positions: list[int], caches: list
                 ) -> None:
    """One batched decode step of the sequences in `group`: each gets its next (greedy) token."""
    logits = decode_step(loaded.model, [out[i][-1] for i in group], [positions[i] for i in group],
                         [caches[i] for i in group])
    for row, i in enumerate(group):
        out[i].append(int(logits[row].argmax()))
        positions[i] += 1


def decode_rate(loaded: LoadedModel, prompts: list[list[int]], rows: int, steps: int, tier: str | None = None,
                attention: str = "per-row") -> tuple[float, list[list[int]]]:
    """Decode tokens/s with `rows` sequences per step (greedy), prefill and each group's first step
    excluded; and the tokens."""
    caches, tokens = _prefilled(loaded, prompts, tier, attention)
    out = [[t] for t in tokens]
    positions = [len(p) for p in prompts]
    elapsed = 0.0
    for start in range(0, len(prompts), rows):
        group = list(range(start, min(start + rows, len(prompts))))
        _greedy_step(loaded, group, out, positions, caches)  # untimed: a shape's first step pays its set-up
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            _greedy_step(loaded, group, out, positions, caches)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
    for cache in caches:
        cache.close()
    return len(prompts) * steps / elapsed, out


def plain_decode_rate(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> float:
    """Decode tokens/s of `plain_generate` one prompt at a time, `steps` decode steps each."""
    elapsed = sum(plain_generate(loaded, ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1)[1] for ids in prompts)
    return len(prompts) * steps / elapsed


WEIGHT_MATMULS = {"aten::mm", "aten::addmm"}


def step_breakdown(loaded: LoadedModel, prompts: list[list[int]], width: int, steps: int) -> dict[str, float]:
    """Where a decode step of `width` sequences spends its time (torch profiler, self CPU time per step),
    and the KV bytes its attention reads, from the shapes of the tensors the attention op was given."""
    caches, tokens = _prefilled(loaded, prompts[:width], None)
    out, positions, group = [[t] for t in tokens], [len(p) for p in prompts[:width]], list(range(width))
    _greedy_step(loaded, group, out, positions, caches)  # the first step outside the profile
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(steps):
            _greedy_step(loaded, group, out, positions, caches)
    for cache in caches:
        cache.close()
    matmul_us = attention_us = kv_bytes_read = 0
    for event in prof.events():
        if event.name in WEIGHT_MATMULS:
            matmul_us += event.self_cpu_time_total
        elif event.name.startswith("aten::_scaled_dot_product"):
            attention_us += event.self_cpu_time_total
            key, value = event.input_shapes[1], event.input_shapes[2]
            kv_bytes_read += loaded.dtype.itemsize * (torch.Size(key).numel() + torch.Size(value).numel())
    return {"matmul_ms": matmul_us / steps / 1e3, "attention_ms": attention_us / steps / 1e3,
            "kv_mb": kv_bytes_read / steps / 1e6}


def plain_read_gbs(nbytes: int) -> float:
    """How fast this process reads memory it does not compute much on: a sum over `nbytes` of float32."""
    data = torch.ones(nbytes // 4)
    data.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        data.sum()
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def decode_section(loaded: LoadedModel, args: argparse.Namespace) -> dict:
    rows = documents(loaded)
    ids = [loaded.tokenizer(r["text"], add_special_tokens=False).input_ids for r in rows]
    pool = [t for doc in ids for t in doc]
    print(f"{'prompt tokens':>13} {'batch':>5} {'attention':>9} {'decode tok/s':>12} {'x batch 1':>9} {'x plain':>7} "
          f"{'x per-row':>9} {'same tokens':>11}")
    rates = {}  # (prompt tokens, batch, attention) -> decode tok/s
    widths_asked = [int(w) for w in args.decode_widths.split(",")]
    for shape in args.decode_shapes.split(","):
        length, count = (int(x) for x in shape.split("x"))
        prompts = [pool[i * 997 % (len(pool) - length):][:length] for i in range(count)]
        plain = plain_decode_rate(loaded, prompts, args.decode_steps)
        print(f"{length:>13} {'plain':>5} {'':>9} {plain:>12.1f} {'':>9} {1.0:>7.2f} {'':>9} {'':>11}", flush=True)
        alone, alone_tokens = decode_rate(loaded, prompts, 1, args.decode_steps)
        for attention in args.attention.split(","):
            for width in sorted({w for w in widths_asked if w <= count} | {count}):
                rate, tokens = ((alone, alone_tokens) if (width, attention) == (1, "per-row")
                                else decode_rate(loaded, prompts, width, args.decode_steps, attention=attention))
                rates[length, width, attention] = rate
                same = sum(a == b for a, b in zip(tokens, alone_tokens))
                per_row = rates.get((length, width, "per-row"))
                print(f"{length:>13} {width:>5} {attention:>9} {rate:>12.1f} {rate / alone:>9.2f} {rate / plain:>7.2f} "
                      f"{rate / per_row if per_row else float('nan'):>9.2f} {same:>9}/{count}", flush=True)
    print("\n`plain`: model.generate one prompt at a time (transformers' default cache), prefill excluded;"
          "\n`x per-row`: against the per-row attention path at the same batch")
    if all((3000, width, "per-row") in rates for width in (1, 8)):
        print("\nwhere a decode step's time goes at 3,000-token prompts (step: the table's rate; weights and "
              "attention:\ntorch profiler, self CPU time per step; other: the rest of the step):")
        print(f"{'batch':>5} {'step ms':>8} {'weights ms':>10} {'attention ms':>12} {'other ms':>8} {'KV read MB':>10} "
              f"{'attention GB/s':>14}")
        long_prompts = [pool[i * 997 % (len(pool) - 3000):][:3000] for i in range(8)]
        for width in (1, 8):
            parts = step_breakdown(loaded, long_prompts, width, args.decode_steps)
            step_ms = 1e3 * width / rates[3000, width, "per-row"]  # the table's rate for this batch: ms per step
            other = step_ms - parts["matmul_ms"] - parts["attention_ms"]
            print(f"{width:>5} {step_ms:>8.1f} {parts['matmul_ms']:>10.1f} {parts['attention_ms']:>12.1f} "
                  f"{other:>8.1f} {parts['kv_mb']:>10.0f} {parts['kv_mb'] / parts['attention_ms']:>14.1f}", flush=True)
        print(f"a plain read of memory in this process: {plain_read_gbs(1 << 30):.1f} GB/s")
    return {"decode_tok_s": [{"prompt_tokens": length, "batch": width, "attention": attention, "tok_s": rate}
                             for (length, width, attention), rate in rates.items()]}


def step_ops_section(loaded: LoadedModel | None, args: argparse.Namespace) -> dict:
    """bench/step_ops.py's table: what one decode step costs the host, by rows, per path."""
    result = step_ops(args.step_ops_steps)
    print(f"Llama-3-8B attention shape (32 layers, 32 q / 8 kv heads, head_dim 128; hidden 64), bf16, 1 thread, "
          f"{result['prompt_tokens']}-token prompts; one decode_step, then its greedy token choice "
          f"(choice: each row's own picker -> the batch's choose_tokens)")
    print(f"{'cache':<12} {'attention':>9} {'rows':>4} {'aten ops':>8} {'launching':>9} {'io launching':>12} "
          f"{'host ms/step':>12} "
          f"{'compute ms':>10} {'other ms':>8} {'wait ms':>7} {'choice launching':>16} {'choice syncs':>12} {'choice ms':>11} "
          f"{'launching+choice':>16}")
    for row in result["table"]:
        launching = f"{row['choice_launching_ops_per_row']}->{row['choice_launching_ops_batched']}"
        syncs = f"{row['choice_host_reads_per_row']}->{row['choice_host_reads_batched']}"
        ms = f"{row['choice_ms_per_row']:.2f}->{row['choice_ms_batched']:.2f}"
        print(f"{row['cache']:<12} {row['attention']:>9} {row['rows']:>4} {row['aten_ops']:>8,} "
              f"{row['launching_ops']:>9,} {row['io_launching_ops']:>12,} {row['host_ms']:>12.1f} "
              f"{row['compute_ms']:>10.1f} {row['other_ms']:>8.1f} {row['wait_ms']:>7.1f} "
              f"{launching:>16} {syncs:>12} {ms:>11} {row['launching_with_choice']:>16,}")
    print("\n32 rows against 1 row:")
    for ratio in result["ratios"]:
        print(f"  {ratio['cache']:<12} {ratio['attention']:>9}: launching ops {ratio['launching_ratio']:.2f}x "
              f"({ratio['with_choice_ratio']:.2f}x with token choice, {ratio['with_io_ratio']:.2f}x with IO threads), "
              f"host ms {ratio['host_ratio']:.2f}x, other ms {ratio['other_ratio']:.2f}x")
    return result


# -- device: an 8B-shaped model, no tokenizer ---------------------------------------------------------
DEVICE_SHAPES = {  # LlamaConfig fields, prompt tokens, rows, long-prompt tokens for the offload rows
    "cuda": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0),
             8192, "1,8,32", 32768),
    "cpu": (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=8192), 256, "1,8,32", 2048),
}


def synthetic_llama(device: torch.device, fields: dict) -> LoadedModel:
    """A random Llama of the given shape, made on the device (no download; bf16 on CUDA, fp32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(attn_implementation="sdpa", pad_token_id=0, eos_token_id=None, bos_token_id=None, **fields)
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    shape = f"llama {fields['num_hidden_layers']}x{fields['hidden_size']} {str(dtype).removeprefix('torch.')}"
    return LoadedModel(model, word_tokenizer(fields["vocab_size"]), shape, device, dtype, 0.0)


def device_read_gbs(device: torch.device, nbytes: int) -> float:
    """How fast this device reads memory it does little arithmetic on: the decode step's ceiling."""
    data = torch.ones(nbytes // 4, device=device)
    data.sum()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        data.sum()
    _sync(device)
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_bytes(loaded: LoadedModel, rows: int, kv_tokens: int) -> int:
    """What one decode step must read: every weight but the embedding table (a lookup), and each row's KV."""
    model = loaded.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not embedding:  # tied: the head reads the table whole
        weights -= embedding.numel() * embedding.element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * loaded.dtype.itemsize
    return weights + rows * kv_tokens * kv_per_token


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions where `tokens` equal `reference`, over the positions both have."""
    pairs = [(a, b) for ours, ref in zip(tokens, reference) for a, b in zip(ours, ref)]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0


def offload_rates(loaded: LoadedModel, prompt_tokens: int, steps: int) -> list[dict]:
    """Decode tok/s of one long prompt streamed from host RAM: ours, and transformers' own offloading (CUDA only)."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, loaded.model.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
    caches = [("tiered-host", lambda: {"past_key_values": TieredCache(loaded.model.config, tier="host")})]
    if loaded.device.type == "cuda":
        caches.append(("offloaded", lambda: {"cache_implementation": "offloaded"}))
    rows = []
    for name, cache_kwargs in caches:
        kwargs = cache_kwargs()
        clock = TokenClock()
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([prompt], device=loaded.device), max_new_tokens=steps + 1,
                                        min_new_tokens=steps + 1, do_sample=False, prefill_chunk_size=2048,
                                        streamer=clock, pad_token_id=0, **kwargs)
        _sync(loaded.device)
        end = time.perf_counter()
        decoded = out.shape[1] - len(prompt) - 1
        rows.append({"cache": name, "prompt_tokens": prompt_tokens, "prefill_s": clock.first_token_at - clock.start,
                     "decode_tok_s": decoded / (end - clock.first_token_at)})
        if "past_key_values" in kwargs:
            rows[-1]["read_wait_per_step_s"] = kwargs["past_key_values"].stats()["read_wait_per_decode_step_s"]
            kwargs["past_key_values"].close()
        _free(loaded.device)
    return rows


def write_report(path: Path | None, report: dict) -> None:
    """The figures so far as JSON: written after every row, so a run that is stopped keeps what finished."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


QUANT_METHODS = ("none", "torchao-int8", "torchao-int4", "bnb-8bit", "bnb-4bit")
QUANT_LAYERS = {"cuda": 8, "cpu": 2}
"""Layers of the model the quantized rows load: Llama-3-8B's layer shapes on CUDA, a quarter of its
depth, so that saving and loading it once per method fits the device script's few minutes."""


def device_quant_section(args: argparse.Namespace) -> dict:
    """Decode tok/s and weight memory under each `model.quantization` this machine can run, the weights
    loaded through kvbatch's own loader (transformers' quantizers) from one saved random checkpoint;
    tokens against the unquantized model's (random weights: speed and memory only, not quality)."""
    from runner.engine.quantization import unavailable

    device = torch.device(args.device)
    fields, prompt_tokens, _, _ = DEVICE_SHAPES[device.type]
    fields = {**fields, "num_hidden_layers": QUANT_LAYERS[device.type]}
    prompt_tokens = min(args.prompt_tokens or prompt_tokens, 2048)
    steps = args.decode_steps
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, fields["vocab_size"], (prompt_tokens,), generator=generator).tolist() for _ in range(8)]
    report = {"layers": fields["num_hidden_layers"], "prompt_tokens": prompt_tokens, "rows": []}
    print(f"quantized weights: llama {fields['num_hidden_layers']}x{fields['hidden_size']} (Llama-3-8B's layers), "
          f"{prompt_tokens}-token prompts, {steps} decode steps, pooled attention")
    print(f"{'method':<13} {'weights MiB':>11} {'peak MiB':>9} {'tok/s 1 row':>11} {'tok/s 8 rows':>12} {'same as none':>12}")
    reference: list[list[int]] | None = None
    with tempfile.TemporaryDirectory(prefix="kvbatch-quant-") as folder:
        made = synthetic_llama(device, fields)
        made.model.save_pretrained(folder)
        made.tokenizer.save_pretrained(folder)
        del made
        _free(device)
        for method in QUANT_METHODS:
            why = unavailable(method, device.type)
            if why is not None:
                print(f"{method:<13} not run: {why}", flush=True)
                report["rows"].append({"method": method, "skipped": why})
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            dtype = "bfloat16" if device.type == "cuda" else "float32"
            try:
                loaded = load_model(ModelConfig(name=folder, dtype=dtype, device=str(device), quantization=method))
            except Exception as e:  # noqa: BLE001 - a library this machine's torch cannot run: say so, go on
                print(f"{method:<13} failed to load: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                report["rows"].append({"method": method, "failed": f"{type(e).__name__}: {e}"})
                continue
            loaded.model.generation_config.eos_token_id = None
            one, tokens = decode_rate(loaded, prompts[:1], 1, steps, attention="pooled")
            eight, _ = decode_rate(loaded, prompts, 8, steps, attention="pooled")
            reference = reference or tokens
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            row = {"method": method, "weight_bytes": loaded.weight_bytes, "peak_device_bytes": peak,
                   "decode_tok_s_1": one, "decode_tok_s_8": eight, "agree_with_none": agreement(tokens, reference)}
            report["rows"].append(row)
            peak_text = f"{peak / 2**20:>9,.0f}" if peak is not None else f"{'n/a':>9}"
            print(f"{method:<13} {loaded.weight_bytes / 2**20:>11,.0f} {peak_text} {one:>11.1f} {eight:>12.1f} "
                  f"{row['agree_with_none']:>12.1%}", flush=True)
            del loaded
            _free(device)
    return report


# -- mix and cli-step: batching through the real CLI -----------------------------------------------
# Batching through the real CLI, and where a batched worker's decode time goes, from its result rows.
#
# Two sections of bench/throughput.py, each one `kvbatch submit` per setting on one shared local Ray:
#
# - mix: real documents of 400-4,000 tokens (licence texts, whole or cut at a paragraph end; those
#   over one pass at context 2048 are map-reduced), SmolLM2-135M fp32, 2 workers x 1 thread, with
#   `batch.max_sequences=1` and batched; `--mix-long TOKENS` adds one long document (licence texts
#   one after another, cut there) of many passes beside them, and says on which workers its passes
#   ran. Docs/hour over the batch phase, and where the workers' time
#   went: prefill (one sequence at a time), decode steps, the rows' decode time and how much of it they
#   spent waiting on another row's prefill (a stall: the worker's one model thread was prefilling).
# - cli-step: ~28 short sequences of bench/step_ops.py's model (Llama-3-8B's attention shape, random
#   weights, saved to a folder with a word tokenizer so the worker loads it like any model), one worker,
#   `batch.attention=pooled`: each sequence's decode tok/s alone (`max_sequences=1`) against in one
#   batch of all of them.
#
# The timeline comes from job.log's `pass_kept` lines: each pass's prefill ran for its `prefill_s` and
# its decode for its `decode_s` up to its `finished_at`, on the worker that ran it (a dealt chunk on
# the worker that took it, not the one that ran its document's merges). A tree whose lines carry no
# timings (55cc39a) is timed from its result rows instead: each document as one prefill then one decode
# on its row's worker, exact only for single-pass documents. Every setting can be changed with
# `--set KEY=VALUE`, given after the bench's own (e.g. a batch engine key), so the same figures can be
# taken either way.

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
          "of it spent waiting on another\npass's prefill on the same worker (bench/throughput.py: each pass on the "
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


# -- rides: a long prompt joining a decoding batch ----------------------------------------------------
# Prefilled whole (batch.prefill_chunk_tokens 0) or riding the decode steps chunk by chunk, side by side
# on the builtin SmolLM2. `--rides-rows` short prompts decode together; once they all do, a long prompt
# joins. Each row is the worker's own engine (`BatchEngine`, `dynamic` caches, greedy fp32, loop stop
# off) with one setting of the chunk; the clock is read after every decode step's token choice, where
# the batch's rows get their tokens. The table gives the decoders' longest wait between two tokens (the
# stall a whole prefill is), the decode steps they made while the long prompt prefilled, the long
# prompt's time to its first token, and the wall time of the whole batch; every row's tokens must equal
# the whole prefill's (the section fails otherwise).
RIDES_MANIFEST = REPO / "examples" / "licenses.jsonl"


def _ride(loaded, chunk: int, short: list[list[int]], long: list[int], new_tokens: int) -> dict:
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

        def _choose(self, rows, logits, chosen=None) -> None:
            super()._choose(rows, logits, chosen)
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
    while engine.plan.most_rows < len(short):  # every short prompt decodes: now the long one joins
        if any(f.done() for f in futures):
            raise SystemExit("a short prompt finished before all of them decoded: raise --new-tokens")
        time.sleep(0.001)
    joined_at = time.perf_counter()
    first_step, rode_before = len(engine.ticks), engine.plan.steps_with_prefill
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
        "decode_steps_while_prefilling": engine.plan.steps_with_prefill - rode_before,  # nobody joins after it
        "long_ttft_s": long_pass.ttft_s,
        "wall_s": wall,
        "tokens": [p.tokens for p in passes] + [long_pass.tokens],
    }


def rides_section(loaded: LoadedModel | None, args: argparse.Namespace) -> dict:
    """The long prompt prefilled whole against riding in `--rides-chunk`-token chunks."""
    assert loaded is not None
    rows = [json.loads(line) for line in RIDES_MANIFEST.read_text().splitlines() if line.strip()]
    texts = [r["text"] if "text" in r else Path(r["path"]).read_text(encoding="utf-8", errors="replace") for r in rows]
    ids = [loaded.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    short = [doc[: args.rides_short] for doc in ids[: args.rides_rows]]
    long = next(doc for doc in sorted(ids, key=len, reverse=True))[: args.rides_long]
    _ride(loaded, args.rides_chunk, short[:1], long[:64], 4)  # warm-up: the shapes' first calls pay their set-up
    whole, rides = [_ride(loaded, chunk, short, long, args.rides_new) for chunk in (0, args.rides_chunk)]
    if rides["tokens"] != whole["tokens"]:
        raise SystemExit("riding changed a token: a bug (greedy fp32 tokens must be identical)")
    print(f"{args.rides_rows} rows of {args.rides_short}-token prompts decode, a {len(long)}-token prompt joins "
          "(greedy fp32 tokens identical in both rows)\n")
    print("| prefill of the joining prompt | decoders' longest wait (s) | decode steps while it prefilled | "
          "its TTFT (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for r, label in ((whole, "whole (`prefill_chunk_tokens: 0`)"), (rides, f"rides, {args.rides_chunk}-token chunks")):
        print(f"| {label} | {r['longest_wait_s']:.2f} | {r['decode_steps_while_prefilling']} | "
              f"{r['long_ttft_s']:.2f} | {r['wall_s']:.2f} |")
    print(f"\nrides / whole: longest wait {rides['longest_wait_s'] / whole['longest_wait_s']:.2f}x, "
          f"TTFT {rides['long_ttft_s'] / whole['long_ttft_s']:.2f}x, wall {rides['wall_s'] / whole['wall_s']:.2f}x")
    return {"rows": [{k: v for k, v in r.items() if k != "tokens"} for r in (whole, rides)]}


SECTIONS = {"docs": docs_section, "anchors": anchors_section, "decode": decode_section, "step-ops": step_ops_section}
CLI_SECTIONS = {"mix": mix_section, "cli-step": cli_step_section, "rides": rides_section}
"""Run by name only (`--sections mix,cli-step`): the issue-21 end-to-end figures, several minutes each."""
WITHOUT_SMOLLM2 = {"step-ops", "cli-step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--sequences", default="1,2,4,8,16")
    parser.add_argument("--layouts", default="2x1,1x2", help="workers x torch threads per worker")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--decode-shapes", default="500x16,1060x8,3000x8", help="prompt tokens x prompts, each")
    parser.add_argument("--decode-widths", default="1,2,4,8,16", help="sequences per decode step")
    parser.add_argument("--attention", default="per-row,pooled", help="decode attention paths (batch.attention)")
    parser.add_argument("--step-ops-steps", type=int, default=10, help="timed steps per step-ops row")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every kvbatch submit of docs, mix and cli-step (after the bench's own)")
    parser.add_argument("--mix-sequences", default="1,auto", help="mix: batch.max_sequences of each run, the first the base")
    parser.add_argument("--mix-tree", type=Path, default=None, metavar="DIR",
                        help="mix: also run every setting from this checkout of another revision, side by side "
                             "(e.g. `git worktree add /tmp/base 55cc39a`)")
    parser.add_argument("--mix-limit", type=float, default=1800.0, metavar="S",
                        help="mix: a run still going after this many seconds is killed and reported unfinished")
    parser.add_argument("--mix-layout", default="2x1", help="mix: workers x torch threads per worker")
    parser.add_argument("--mix-docs", type=int, default=len(MIX), help="mix: the first this many documents (a quick check)")
    parser.add_argument("--mix-long", type=int, default=0, metavar="TOKENS",
                        help="mix: also one long document of this many tokens (licence texts one after another)")
    parser.add_argument("--step-rows", type=int, default=28, help="cli-step: sequences decoding together")
    parser.add_argument("--step-words", type=int, default=48, help="cli-step: words (tokens) per document")
    parser.add_argument("--step-tokens", type=int, default=96, help="cli-step: new tokens per sequence")
    parser.add_argument("--rides-rows", type=int, default=4, help="rides: short prompts decoding when the long one joins")
    parser.add_argument("--rides-short", type=int, default=128, help="rides: the short prompts' tokens")
    parser.add_argument("--rides-long", type=int, default=1536, help="rides: the joining prompt's tokens")
    parser.add_argument("--rides-new", type=int, default=96, help="rides: the short prompts' new tokens")
    parser.add_argument("--rides-chunk", type=int, default=256, help="rides: batch.prefill_chunk_tokens of the riding row")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every section's figures")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device-quant: where it runs")
    parser.add_argument("--prompt-tokens", type=int, help="device-quant: prompt length (at most 2048)")
    parser.add_argument("--report", type=Path, help="device-quant: also write its figures to this JSON file")
    args = parser.parse_args()
    if args.sections == "device-quant":
        write_report(args.report, device_quant_section(args))
        return
    sections = args.sections.split(",")
    torch.set_num_threads(2)
    loaded = None
    if set(sections) - WITHOUT_SMOLLM2:
        loaded = load_model(ModelConfig(name="builtin:smollm2-135m", dtype="float32", device="cpu"))
        print(f"SmolLM2-135M fp32 on {loaded.device}, {torch.get_num_threads()} torch threads in this process; "
              f"{NEW_TOKENS} new tokens, context {CONTEXT}")
    figures = {}
    for section in sections:
        print(f"\n## {section}\n", flush=True)
        figures[section] = {**SECTIONS, **CLI_SECTIONS}[section](loaded, args)
    if args.json:
        print(json.dumps({name: value for name, value in figures.items() if value is not None}))

if __name__ == "__main__":
    main()
