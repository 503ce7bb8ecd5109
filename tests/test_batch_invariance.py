"""A summary never depends on its batch-mates or on the attention path its row takes (issue 36).

Ten real documents through the worker's `BatchEngine` on the builtin tiny random model: one at a
time and eight at a time, pooled (the KV pool's one call per layer) and per row (each row's own
cache), and tiered-host beside them, in bf16 and fp32. Before, bf16 tokens differed (6 of 10 documents
pooled alone vs pooled in a batch): SDPA rounds a row's sums by the span it is handed, and a joining
prompt rode the batch in 256-token chunks while a prompt alone was prefilled whole in 512-token ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs.config import ModelConfig, SummarizeConfig
from runner.engine.batch_engine import BatchEngine
from runner.engine.kvcache import ResidentMeter
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import LoadedModel, load_model
from runner.engine.pooled_attention import SPAN_GRANULE, PooledStep
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, run_batch
from tests.helpers.cli import LICENSES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCUMENTS = 10
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def loaded(request) -> LoadedModel:
    return load_model(ModelConfig(name="builtin:tiny-random", device="cpu", dtype=request.param))


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    """Openings of real licences, 80 to 1,500 tokens: rows far apart in length, several prompt chunks."""
    texts = [path.read_text(errors="replace") for path in sorted(LICENSES.iterdir()) if path.is_file()]
    return [loaded.tokenizer(text[: 400 + 700 * i])["input_ids"] for i, text in enumerate(texts[:DOCUMENTS])]


def _tokens(loaded: LoadedModel, prompts: list[list[int]], strategy: str, max_sequences: int, pooled: bool,
            tmp_path: Path) -> list[list[int]]:
    pool = (KVPool.for_model(loaded.model.config, loaded.dtype, loaded.device,
                             ResidentMeter(None, "the test's device", "cache.device_kv_budget_bytes")) if pooled else None)
    settings = SummarizeConfig(**PLAIN, loop_stop={"enabled": False})
    engine = BatchEngine(loaded, settings, "auto", max_sequences, BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, loaded.model, strategy, tmp_path, prompts,
                                           [NEW_TOKENS] * len(prompts), kv_pool=pool)]
    finally:
        engine.close()
    # prompts ride the steps in chunks, so the longest join as the first leave: several rows, not all eight
    assert (engine.plan.most_rows >= 4) if max_sequences > 1 else engine.plan.most_rows == 1, "no batch ran"
    if pool is not None and strategy == "dynamic":
        assert pool.most_rows == engine.plan.most_rows, "the pooled step never attended the batch in one call"
    return got


def test_tokens_are_the_same_alone_in_a_batch_and_on_either_attention_path(loaded: LoadedModel, tmp_path: Path) -> None:
    prompts = _prompts(loaded)
    assert len(prompts) == DOCUMENTS and max(map(len, prompts)) > 4 * min(map(len, prompts))
    reference = _tokens(loaded, prompts, "dynamic", 1, True, tmp_path)
    assert len({tuple(t) for t in reference}) == DOCUMENTS, "the documents' tokens should differ from each other"
    for strategy, max_sequences, pooled in [("dynamic", 8, True), ("dynamic", 1, False), ("dynamic", 8, False),
                                            ("tiered-host", 8, True)]:
        got = _tokens(loaded, prompts, strategy, max_sequences, pooled, tmp_path)
        same = sum(a == b for a, b in zip(got, reference))
        assert same == DOCUMENTS, (f"{loaded.dtype} {strategy} {'pooled' if pooled else 'per-row'} at "
                                   f"max_sequences={max_sequences}: {same}/{DOCUMENTS} documents as pooled alone")


def test_every_pooled_attention_call_reads_an_aligned_span(tiny_random: LoadedModel) -> None:
    """Odd lengths far apart (two runs): each run's span and the mask's rows start on granule boundaries,
    so a one-row slice of the mask starts on a 128-byte boundary (cuDNN faulted on an odd span's)."""
    pool = KVPool.for_model(tiny_random.model.config, torch.bfloat16, torch.device("cpu"),
                            ResidentMeter(None, "the test's device", "cache.device_kv_budget_bytes"))
    caches = [PooledCache(pool, 2000) for _ in range(5)]
    for cache, length in zip(caches, (1999, 3, 5, 7, 9)):
        cache.length = length
    step = PooledStep(pool, caches)
    assert len(step.runs) == 2 and step.span == 2048
    assert all(span % SPAN_GRANULE == 0 for _, _, span in step.runs)
    assert step.mask.shape[-1] % SPAN_GRANULE == 0
    for start, end, span in step.runs:
        part = step.mask[start:end, :, :, :span]
        assert (part.data_ptr() - step.mask.data_ptr()) % 128 == 0 and part.stride(0) * part.element_size() % 128 == 0
    for cache in caches:
        cache.close()
