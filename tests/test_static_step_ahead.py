"""A decode step launched before the step before it is read (runner/engine/batch_engine.py `_decode`,
issue 48): its rows' input tokens come from the device, their bans are listed by what that token
could be, and the host reads the step before while the device runs this one. What that must not
change: a row that ends at the step before (its end-of-sequence token, seen a step late) keeps the
tokens it has alone and drops the step it took beyond; a memory error in a step launched ahead keeps
the step before's tokens and splits the batch as any memory error does. Tiny random models on the CPU,
where the static step runs eagerly: each test checks that the rows' inputs did come from the device."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.config import LoopStopConfig, SummarizeConfig
from runner.engine.batch_engine import BatchEngine
from runner.engine.static_step import StaticStep
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, as_loaded_model, cpu_kv_pool, run_batch, tokens_alone
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [37, 20, 51, 9, 44, 28]
NEW = 24


def _run(model, tokenizer, tmp_path: Path, settings: dict, static: bool, budget: int | None = None,
         expected: bool | None = None) -> tuple[list[list[int]], BatchEngine, StaticStep | None]:
    pool = cpu_kv_pool(model, budget)
    step = StaticStep(model, pool, graphs=False) if static else None
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**settings, loop_stop={"enabled": False}),
                         "auto", len(LENGTHS), BIG, _is_memory_error, prefill_chunk_tokens=0, static=step)
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS]
    try:
        got = [g.tokens for g in run_batch(engine, model, "dynamic", tmp_path, prompts, [NEW] * len(prompts),
                                           kv_pool=pool, expected=expected)]
    finally:
        engine.close()
    return got, engine, step


def test_an_end_of_sequence_token_seen_a_step_late_ends_the_row_where_it_ends_alone(tokenizer, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    free, _, _ = _run(model, tokenizer, tmp_path / "free", PLAIN, static=True)
    firsts = {tokens[0] for tokens in free}  # a row ending at its first token never decodes
    eos = next(token for tokens in free for token in tokens[2:] if token not in firsts)  # some row ends midway
    settings = {**PLAIN, "generation": {"eos_token_id": eos}}
    eager, _, _ = _run(model, tokenizer, tmp_path / "eager", settings, static=False)
    ahead, engine, step = _run(model, tokenizer, tmp_path / "ahead", settings, static=True)
    assert ahead == eager
    ended = [tokens for tokens in ahead if len(tokens) < NEW]
    assert ended and all(tokens[-1] == eos and len(tokens) > 2 for tokens in ended)  # at its end-of-sequence token
    assert step is not None and step.ahead_row_steps > 0
    # an ended row's step beyond was run (the step's rows were launched before its end was read) and
    # dropped: no row-step of the plan's counts it
    assert engine.plan.tokens_decoded == sum(len(tokens) - 1 for tokens in ahead) < step.row_steps


def test_a_memory_error_in_a_step_launched_ahead_splits_the_batch_and_keeps_every_token(
        tokenizer, tmp_path: Path) -> None:
    """Each cache claims one 64-token granule of the pool (no length up front), so the pool must grow
    as the rows pass 64 tokens, which a device budget of one full-length row refuses beside another:
    a memory error at a step past the first (every one of those launched ahead), the batch split, and
    the rows decoded again alone, where they fit."""
    model = tiny_model("llama-gqa")
    pool = cpu_kv_pool(model)
    budget = pool.bytes_for(1, 128)  # one row at its full length (up to 51 + 24 tokens: 128 with growth)
    got, engine, step = _run(model, tokenizer, tmp_path, PLAIN, static=True, budget=budget, expected=False)
    assert got == [tokens_alone(model, random_prompt(n)[0].tolist(), NEW, LoopStopConfig(enabled=False))
                   for n in LENGTHS]
    assert engine.plan.splits > 0 and step is not None and step.ahead_row_steps > 0
