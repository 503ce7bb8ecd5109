"""Quantized weights through transformers' quantizers (runner/engine/quantization.py): what they load
as, that every cache strategy gives the same quantized model the same tokens, alone and batched, and
what is refused at submit."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from jobs.config import CacheConfig, JobConfig, ModelConfig, SummarizeConfig
from jobs.kvplan import kv_bytes
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.kvcache import build_cache, kv_shape, ram_left_by_weights
from runner.engine.kvcache.strategies import RAM_SHARE
from runner.engine.model_loader import load_model
from runner.engine.probes import StageMemory
from runner.engine.quantization import weight_bytes
from runner.engine.worker import SummaryWorker, _is_memory_error
from tests.helpers.batching import PLAIN
from tests.helpers.cli import LICENSES, TINY_CONFIG, export_rows, kvbatch, refusal, write_jsonl

CPU_METHODS = ["bnb-8bit", "bnb-4bit", "torchao-int8"]
LENGTHS = [37, 20, 51]
NEW = [12, 20, 9]  # new tokens of each of the three prompts


@pytest.fixture(scope="module", params=CPU_METHODS)
def quantized(request):
    return load_model(ModelConfig(name="builtin:tiny-random", quantization=request.param))


def _prompt(n: int) -> list[int]:
    generator = torch.Generator().manual_seed(n)
    return torch.randint(100, 20000, (n,), generator=generator).tolist()


def test_the_weights_are_quantized_by_transformers_and_weigh_less(quantized) -> None:
    fp32 = load_model(ModelConfig(name="builtin:tiny-random"))
    layer = quantized.model.model.layers[0].self_attn.q_proj
    kind = {"bnb-8bit": "Int8Params", "bnb-4bit": "Params4bit", "torchao-int8": "Int8Tensor"}[quantized.quantization]
    assert type(layer.weight).__name__ == kind
    assert quantized.model.config.quantization_config is not None  # transformers' own quantizer did it
    # the decoder's linear layers shrink (the 49k-token embedding, most of this model, is not quantized)
    linear = [m for m in quantized.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    fp32_linear = [m for m in fp32.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    quantized_bytes = sum(weight_bytes(m) for m in linear)
    full_bytes = sum(weight_bytes(m) for m in fp32_linear)
    assert quantized_bytes < full_bytes * (0.4 if quantized.quantization != "bnb-4bit" else 0.25)
    assert quantized.weight_bytes == weight_bytes(quantized.model) < fp32.weight_bytes


def _alone(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             past_key_values=DynamicCache(config=model.config))
    return out[0, len(prompt):].tolist()


def _scheduled(loaded, strategy: str, width: int, prompts: list[list[int]], folder: Path) -> list[list[int]]:
    """Each prompt's tokens through the worker's engine, `width` sequences decoding at once."""
    settings = SummarizeConfig(**PLAIN, prefill_chunk_size=16, loop_stop={"enabled": False})
    cfg = CacheConfig(block_tokens=8)
    model = loaded.model
    engine = BatchEngine(loaded, settings, "auto", width, 1 << 40, _is_memory_error)
    try:
        futures = [engine.submit(PassRequest(
            p, n,
            make_cache=lambda i=i: build_cache(strategy, model, cfg, folder / f"{strategy}-{width}-{i}", None, None),
            device_bytes=kv_bytes(kv_shape(model.config), len(p) + n), memory=StageMemory(),
        )) for i, (p, n) in enumerate(zip(prompts, NEW))]
        got = [f.result(timeout=300).generation.tokens for f in futures]
    finally:
        engine.close()
    assert engine.plan.most_rows == width
    return got


def test_every_cache_strategy_gives_the_quantized_model_its_dynamic_tokens(quantized, tmp_path) -> None:
    """tiered-host and tiered-disk, alone (one sequence at a time) and batched (three at once): the same
    tokens as the `dynamic` cache on the same quantized model, one sequence at a time."""
    prompts = [_prompt(n) for n in LENGTHS]
    expected = _scheduled(quantized, "dynamic", 1, prompts, tmp_path)
    assert len({tuple(e) for e in expected}) == len(expected)  # varied, so a mixed-up row would show
    for strategy in ("dynamic", "tiered-host", "tiered-disk"):
        for width in (1, 3):
            got = _scheduled(quantized, strategy, width, prompts, tmp_path)
            assert got == expected, f"{quantized.quantization} {strategy} width {width}"


@pytest.mark.slow
@pytest.mark.parametrize("method", CPU_METHODS)
def test_batch_mates_do_not_change_the_builtin_models_quantized_tokens(method, tmp_path) -> None:
    """On real weights (SmolLM2's activations have outliers), three sequences decoded together get the
    tokens each gets alone: bnb-8bit's outlier columns, chosen over every row of a matmul, would not."""
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", quantization=method))
    ids = loaded.tokenizer((LICENSES / "BSD").read_text())["input_ids"]
    prompts = [ids[:150], ids[100:260], ids[200:330]]
    assert _scheduled(loaded, "dynamic", 3, prompts, tmp_path) == _scheduled(loaded, "dynamic", 1, prompts, tmp_path)


def test_the_worker_plans_with_the_quantized_weights(tmp_path) -> None:
    """The worker reports the quantized weights' real bytes and the method, and derives its `auto`
    budgets from them: the RAM available before the load less those bytes (never more than is available
    after it), this worker's RAM_SHARE of that."""
    config = JobConfig.model_validate({"model": {"name": "builtin:tiny-random", "quantization": "bnb-4bit"}})
    worker = SummaryWorker(config, "job", str(tmp_path / "offload"))
    try:
        info = worker.info()
        assert info["quantization"] == "bnb-4bit"
        assert info["weight_bytes"] == weight_bytes(worker.loaded.model)
        assert info["weight_bytes"] < load_model(ModelConfig(name="builtin:tiny-random")).weight_bytes
        assert 0 < info["ram_left"] <= info["ram_before_load"] - info["weight_bytes"]
        budget = int(info["ram_left"] * RAM_SHARE)
        assert info["device_kv_budget_bytes"] == info["host_kv_budget_bytes"] == budget
    finally:
        worker.engine.close()


def test_the_auto_budget_counts_a_quantized_models_packed_bytes() -> None:
    """Before the same free RAM, the bnb-4bit model leaves the caches exactly the bytes its packed weights
    save over float32's; what is free after the load caps it (a load's leftovers count too)."""
    packed = load_model(ModelConfig(name="builtin:tiny-random", quantization="bnb-4bit")).weight_bytes
    full = load_model(ModelConfig(name="builtin:tiny-random")).weight_bytes
    assert packed < full
    free = 16 << 30
    gained = ram_left_by_weights(free, packed, free) - ram_left_by_weights(free, full, free)
    assert gained == full - packed
    assert ram_left_by_weights(free, packed, 1 << 30) == 1 << 30
    assert ram_left_by_weights(1 << 20, full, free) == 0


def test_a_method_this_machine_cannot_run_is_exit_2_at_submit(tmp_path) -> None:
    """torchao-int4 is a CUDA kernel: on a CPU it is refused before anything runs, in one line."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: torchao-int4 can run here")
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "hello"}])
    proc = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"),
                   "--set", "model.quantization=torchao-int4")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "model.quantization torchao-int4" in lines[0] and "CUDA" in lines[0] and "bnb-4bit" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "job").exists()  # refused before the job folder was made


def test_a_quantized_checkpoint_loads_as_it_is_and_is_reported(tmp_path) -> None:
    saved = tmp_path / "bnb8-checkpoint"
    first = load_model(ModelConfig(name="builtin:tiny-random", quantization="bnb-8bit"))
    first.model.save_pretrained(saved)
    first.tokenizer.save_pretrained(saved)
    assert "quantization_config" in json.loads((saved / "config.json").read_text())
    again = load_model(ModelConfig(name=str(saved)))
    assert again.quantization == "checkpoint:bitsandbytes"
    assert type(again.model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Params"
    prompt = _prompt(30)
    assert _alone(again.model, prompt, 8) == _alone(first.model, prompt, 8)
    # asking for a method on top of it is refused at submit
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "hello"}])
    proc = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"),
                   "--set", f"model.name={saved}", "--set", "model.quantization=bnb-4bit")
    assert "quantized already (checkpoint:bitsandbytes)" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def real_document_jobs(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each method's submit of one real document, its export and status, the three jobs at once (one
    worker each: Ray places two at a time, the third waits for a free CPU)."""
    manifest = write_jsonl(tmp_path_factory.mktemp("bsd") / "m.jsonl", [{"id": "bsd", "path": str(LICENSES / "BSD")}])
    jobs = {method: tmp_path_factory.mktemp(method) / "job" for method in CPU_METHODS}

    def run(method: str) -> dict:
        job = jobs[method]
        kvbatch("submit", str(manifest), "-j", str(job), "--address", ray_address,
                "--set", "model.name=builtin:smollm2-135m", "--set", f"model.quantization={method}",
                "--set", "summarize.max_new_tokens=24", "--set", "workers.count=1", check=0)
        return {"rows": export_rows(job), "status": json.loads(kvbatch("status", str(job), "--json", check=0).stdout)}

    with ThreadPoolExecutor(len(CPU_METHODS)) as pool:
        return dict(zip(CPU_METHODS, pool.map(run, CPU_METHODS)))


@pytest.mark.slow
@pytest.mark.parametrize("method", CPU_METHODS)
def test_the_builtin_model_summarises_a_real_document_quantized(method, real_document_jobs) -> None:
    (row,) = real_document_jobs[method]["rows"]
    assert row["status"] == "done" and row["quantization"] == method
    assert row["stop_reason"] in ("eos", "length", "repetition")
    words = (row["summary"] + row["summary_tail"]).lower()  # all it wrote: 24 tokens may end mid-sentence
    # words of the BSD licence itself: bnb-8bit (bitsandbytes 0.50.2) summarises it as "a work of the regents of
    # the university of california", which names none of the generic ones
    about = ("license", "licence", "software", "copyright", "redistribution", "regents", "university")
    assert len(words.split()) >= 5 and any(w in words for w in about), words
    assert real_document_jobs[method]["status"]["quantization"] == {method: 1}


def test_unquantized_rows_say_none(tmp_path: Path, ray_address) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short note about a meeting on Thursday."}])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address, check=0)
    (row,) = export_rows(job)
    assert row["quantization"] == "none" and row["stop_reason"] in ("eos", "length", "repetition")
