"""A joining prompt rides the batch's decode steps chunk by chunk (batch.prefill_chunk_tokens): its
chunk shares each forward pass with the decode rows, so they keep decoding while it prefills, and
every sequence's greedy fp32 tokens stay those plain `model.generate` gives it alone.

Real tiny random models and caches (tests/test_batching.py's, tests/test_pooled.py's), the real
engine; each test asserts that the step it targets ran (the engine's count of decode steps
that carried a chunk, the pool's rows), so none passes by prefilling every prompt whole.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from jobs.config import ConfigError, LoopStopConfig, SummarizeConfig, load_config
from runner.engine.batch_engine import BatchEngine
from runner.engine.worker import SummaryWorker, _is_memory_error
from tests.helpers.batching import BIG, PLAIN, as_loaded_model, cpu_kv_pool, run_batch, tokens_alone
from tests.helpers.cli import TINY_CONFIG
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 16
NO_LOOP_STOP = LoopStopConfig(enabled=False)  # random models loop: every sequence runs its full length


def _engine(model: PreTrainedModel, tokenizer, width: int, chunk: int = CHUNK) -> BatchEngine:
    return BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN, loop_stop=NO_LOOP_STOP), "auto", width, BIG,
                          _is_memory_error, prefill_chunk_tokens=chunk)


def _chunks(*lengths: int) -> int:
    return sum(math.ceil(n / CHUNK) for n in lengths)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("path", ["pooled", "per-row"])
def test_long_prompts_ride_the_decode_steps_and_every_sequence_keeps_its_tokens_alone(
        path: str, attention: str, tokenizer, tmp_path: Path) -> None:
    """A short prompt decodes 60 tokens; two prompts of several chunks join while it decodes. Every
    chunk of theirs rode a decode step (none stalled the batch), and every sequence's tokens are its
    tokens alone."""
    model = tiny_model("llama-gqa")
    model.set_attn_implementation(attention)
    prompts = [random_prompt(n)[0].tolist() for n in (9, 100, 75)]
    new = [60, 12, 20]
    pool = cpu_kv_pool(model) if path == "pooled" else None
    engine = _engine(model, tokenizer, 3)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic"] * 3, tmp_path, prompts, new, kv_pool=pool)]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n, NO_LOOP_STOP) for p, n in zip(prompts, new)]
    assert engine.plan.steps_with_prefill == _chunks(100, 75)  # the moment: a chunk and decode rows in one forward
    assert engine.plan.most_rows == 3
    if pool is not None:
        assert pool.most_rows == 3 and pool.owners == [] and pool.meter.total == 0


def test_a_prompt_keeps_riding_when_its_batch_mates_finish_mid_prefill(tokenizer, tmp_path: Path) -> None:
    """The decoding sequence ends after 3 tokens; the long prompt's last chunks go alone (no decode
    rows in their forward pass), and it still gets its tokens alone."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in (9, 120)]
    new = [3, 10]
    engine = _engine(model, tokenizer, 2)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic"] * 2, tmp_path, prompts, new, kv_pool=None)]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n, NO_LOOP_STOP) for p, n in zip(prompts, new)]
    assert 0 < engine.plan.steps_with_prefill < _chunks(120)


def test_without_chunks_a_joining_prompt_stalls_the_batch(tokenizer, tmp_path: Path) -> None:
    """batch.prefill_chunk_tokens 0 is the step before this change: the same tokens, and no decode
    step ran while a prompt prefilled."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in (9, 100)]
    new = [40, 12]
    engine = _engine(model, tokenizer, 2, chunk=0)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic"] * 2, tmp_path, prompts, new, kv_pool=None)]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n, NO_LOOP_STOP) for p, n in zip(prompts, new)]
    assert engine.plan.steps_with_prefill == 0 and engine.plan.most_rows == 2


def test_tiered_rows_and_sliding_windows_keep_the_whole_prefill(tokenizer, tmp_path: Path) -> None:
    """A tiered cache's prompt is prefilled whole (layer-major) even beside decode rows, in the same
    batch as a dynamic one that rides; a model with sliding-window layers never chunks."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in (9, 100, 70)]
    new = [50, 10, 10]
    engine = _engine(model, tokenizer, 3)
    try:
        got = [g.tokens for g in run_batch(engine, model, ["dynamic", "tiered-host", "dynamic"], tmp_path, prompts, new, kv_pool=cpu_kv_pool(model))]
    finally:
        engine.close()
    assert got == [tokens_alone(model, p, n, NO_LOOP_STOP) for p, n in zip(prompts, new)]
    assert engine.plan.steps_with_prefill == _chunks(70)  # the dynamic one's chunks only
    sliding = _engine(tiny_model("mistral-sliding"), tokenizer, 2)
    sliding.close()
    assert sliding.prefill_chunk_tokens == 0


def test_batch_prefill_chunk_tokens_is_validated_and_reaches_the_workers_engine(tmp_path: Path) -> None:
    assert load_config(None, []).batch.prefill_chunk_tokens == 256
    assert load_config(None, ["batch.prefill_chunk_tokens=0"]).batch.prefill_chunk_tokens == 0
    with pytest.raises(ConfigError, match=r"batch\.prefill_chunk_tokens"):
        load_config(None, ["batch.prefill_chunk_tokens=-1"])
    config = load_config(TINY_CONFIG, ["batch.prefill_chunk_tokens=32"])
    worker = SummaryWorker(config, "job", str(tmp_path), threads=1)
    worker.engine.close()
    assert worker.engine.prefill_chunk_tokens == 32
