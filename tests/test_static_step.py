"""The static decode step (runner/engine/static_step.py, `batch.static_step`): on the CPU it runs eagerly,
the same step a CUDA graph captures on a GPU (tests/test_cuda.py replays it there).

Its tokens are today's pooled step's (`mixed_step`), token for token, in fp32 and bf16 at 1, 8 and 32
rows of mixed lengths, greedy (the token chosen on the device) and with logits processors (chosen
from its logits); and the step reads nothing back from the device: it runs on the meta device, whose
tensors hold no data, where any read raises.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from jobs.attention import static_step_on
from jobs.config import SummarizeConfig, load_config
from runner.engine.batch_engine import BatchEngine
from runner.engine.batched_logits import ANY
from runner.engine.kvcache import ResidentMeter
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import LoadedModel
from runner.engine.ragged import PrefillChunk, mixed_step
from runner.engine.static_step import BUCKETS, Eager, StaticStep, bucket
from runner.engine.word_pieces import WordPieces
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, run_batch
from tests.helpers.cli import TINY_CONFIG
from tests.helpers.models import VOCAB, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = 48
LENGTHS = [5 + (37 * i) % 150 for i in range(PROMPTS)]  # 5 to 152 tokens, mixed
NEW = [34 + (11 * i) % 19 for i in range(PROMPTS)]  # past the 32 joins (a prompt a step); rows leave at different steps
SETTINGS = {"plain greedy": PLAIN, "summary ban": {"generation": {}, "no_repeat_summary_ngram": 3},
            "processors": {"generation": {"repetition_penalty": 1.3}, "no_repeat_summary_ngram": 3}}
"""Greedy chosen in the step: plainly, and over the default config's summary n-gram ban (with its word
pieces); and from the step's logits on the host (a repetition penalty has no form in the step)."""
PIECES = WordPieces([" w" if i % 2 == 0 else "x" for i in range(VOCAB)])
"""Word pieces for the random models' VOCAB ids: even ids begin a word, odd ones glue on, so the ban's
glue rule (runner/engine/summary_ngrams.py) comes into play."""


def _run(model, tokenizer, dtype: torch.dtype, max_sequences: int, settings: dict, static: bool, tmp_path: Path
         ) -> tuple[list[list[int]], StaticStep | None]:
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name="tiny", device=torch.device("cpu"), dtype=dtype,
                         load_s=0.0)
    loaded.word_pieces = PIECES  # the real tokenizer's first VOCAB ids hold no word start
    pool = KVPool.for_model(model.config, dtype, torch.device("cpu"), ResidentMeter(None, "the test's device", ""))
    # eager: the step a CUDA graph captures
    step = StaticStep(model, pool, graphs=False, pieces=loaded.word_pieces) if static else None
    engine = BatchEngine(loaded, SummarizeConfig(**settings, loop_stop={"enabled": False}), "auto",
                               max_sequences, BIG, _is_memory_error, static=step)
    count = max(4, max_sequences + max_sequences // 2)  # some join as others leave
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:count]]
    try:
        got = [g.tokens for g in run_batch(engine, model, "dynamic", tmp_path, prompts, NEW[:count], kv_pool=pool)]
    finally:
        engine.close()
    assert engine.plan.most_rows == max_sequences
    return got, step


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("max_sequences", [1, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_static_step_gives_todays_tokens(dtype: torch.dtype, max_sequences: int, settings: str, tokenizer,
                                             tmp_path: Path) -> None:
    model = tiny_model("llama-gqa", dtype)
    today, _ = _run(model, tokenizer, dtype, max_sequences, SETTINGS[settings], False, tmp_path)
    static, step = _run(model, tokenizer, dtype, max_sequences, SETTINGS[settings], True, tmp_path)
    assert step is not None and not step.graphs and step.captures == 0
    assert step.steps > 0 and max(step.buckets_run) == bucket(max_sequences), "the static step never ran that batch"
    if settings == "processors":
        assert step.banned_steps == 0
    else:  # every step's tokens chosen in the step (a row's first token is the prompt's, chosen alone)
        assert step.banned_steps == step.steps
        assert (step.glued_row_steps > 0) == (settings == "summary ban"), "no banned word start glued"
        # most rows' inputs came from the device: the step launched before the one before it was read
        assert step.ahead_row_steps > 0.5 * sum(NEW[:len(static)]), step.ahead_row_steps
    assert static == today


def test_padding_rows_take_free_slots_and_leave_the_real_rows_alone(tokenizer, tmp_path: Path) -> None:
    """Three rows padded to a bucket of four: the fourth slot is written and never read."""
    assert bucket(3) == 4 and bucket(17) == 32 and BUCKETS[:4] == (1, 2, 4, 8)
    model = tiny_model("llama-gqa")
    today, _ = _run(model, tokenizer, torch.float32, 3, PLAIN, False, tmp_path)
    static, step = _run(model, tokenizer, torch.float32, 3, PLAIN, True, tmp_path)
    assert step is not None and 4 in step.buckets_run and static == today


def _on_the_meta_device() -> tuple[torch.nn.Module, KVPool, list[PooledCache]]:
    """A tiny model, its KV pool and three rows of 40, 7 and 90 tokens, on the meta device (no data)."""
    model = tiny_model("llama-gqa").to("meta")
    pool = KVPool.for_model(model.config, torch.float32, torch.device("meta"),
                            ResidentMeter(None, "the test's device", ""))
    caches = [PooledCache(pool, 100) for _ in range(3)]
    for cache, length in zip(caches, (40, 7, 90)):
        cache.length = length
    return model, pool, caches


def test_the_static_step_reads_nothing_back_from_the_device() -> None:
    """The whole step, model forward and token choice (bans included) on the meta device: it ends with
    each row's logits and token as (data-less) device tensors; the caller's read is what raises."""
    model, pool, caches = _on_the_meta_device()
    meta = torch.device("meta")
    step = StaticStep(model, pool, graphs=False, pieces=PIECES)
    assert all(step.why_eager(cache) is None for cache in caches)
    # the default config's choice: the summary's n-gram ban, the third row's by the token its input is,
    # which comes from the device (the step before's, not read)
    bans = [[(ANY, [1, 2], True)], [], [(7, [3], False), (9, [4], True)]]
    assert all(step.ban_fits(ban) for ban in bans)
    before = torch.empty(4, dtype=torch.long, device=meta)
    logits, tokens = step.run([5, 6, 0], caches, bans, ahead=(before, [None, None, 2]))
    assert logits.device == meta and logits.shape == (3, model.config.vocab_size) and tokens.shape == (3,)
    assert [cache.length for cache in caches] == [41, 8, 91] and step.steps == 1 and step.ahead_row_steps == 1
    with pytest.raises(NotImplementedError):  # any read of a value inside the step would have raised the same
        tokens.tolist()


def test_the_mixed_step_with_a_riding_prompt_reads_nothing_back_from_the_device() -> None:
    """The eager step a riding prompt chunk takes (`mixed_step`: pool rows, a chunk of a joining
    prompt beside them, its last position's logits kept) on the meta device: no read of a value."""
    model, pool, caches = _on_the_meta_device()
    meta = torch.device("meta")
    joining = PooledCache(pool, 100)
    chunk = PrefillChunk(joining, list(range(1, 20)), 0, wants_logits=True)
    logits, first = mixed_step(model, [5, 6, 7], [40, 7, 90], caches, chunk)
    assert logits.device == meta and logits.shape == (3, model.config.vocab_size)
    assert first is not None and first.shape == (1, model.config.vocab_size)
    assert [cache.length for cache in caches] == [41, 8, 91] and joining.length == 19
    with pytest.raises(NotImplementedError):
        logits.argmax(-1).tolist()


def test_a_step_with_a_row_outside_the_pool_is_not_static(tiny_random: LoadedModel) -> None:
    model = tiny_model("llama-gqa")
    pool = KVPool.for_model(model.config, torch.float32, torch.device("cpu"), ResidentMeter(None, "device", ""))
    caches = [PooledCache(pool, 64) for _ in range(3)]
    step = StaticStep(model, pool, graphs=False)
    # each row's own: in any order, or with a slot sitting out (its prompt riding: a passenger of the step)
    assert all(step.why_eager(cache) is None for cache in caches)
    other = DynamicCache(config=model.config)
    assert step.why_eager(other) == Eager.NOT_POOL
    for cache in caches:
        cache.close()


def test_auto_is_on_with_cuda_only_and_never_off_the_pooled_path() -> None:
    assert load_config(TINY_CONFIG, []).batch.static_step == "auto"
    assert static_step_on("auto", "cuda", "pooled") and not static_step_on("auto", "cpu", "pooled")
    assert static_step_on("on", "cpu", "pooled") and not static_step_on("on", "cuda", "per-row")
    assert not static_step_on("off", "cuda", "pooled")
