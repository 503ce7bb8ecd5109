"""Every pool row stays on the static step (runner/engine/static_step.py), whatever else its step runs
(issue 48): a prompt riding the step chunk by chunk, and rows whose KV is not a pool slot (tiered
rungs), run as their own eager forward beside it (`BatchEngine._step`). Real tiny random models, caches
and engine; the reference is plain `model.generate` one prompt at a time and the same batch with the
static step off; each test counts the row-steps that went through the static step, so none passes by
running the eager step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from jobs.config import LoopStopConfig, SummarizeConfig
from jobs.outcome import CallOutcome, fold_passes, static_share
from runner.engine.batch_engine import BatchEngine
from runner.engine.kvcache import ResidentMeter
from runner.engine.kvcache.pool import KVPool
from runner.engine.model_loader import LoadedModel
from runner.engine.static_step import Eager, StaticStep
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, run_batch, tokens_alone
from tests.helpers.models import random_prompt, tiny_model
from tests.helpers.results import kept_pass

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 16
NO_LOOP_STOP = LoopStopConfig(enabled=False)  # random models loop: every sequence runs its full length


def _run(model: PreTrainedModel, tokenizer, tmp_path: Path, strategies: list[str], prompts: list[list[int]],
         new: list[int], static: bool) -> tuple[list[list[int]], BatchEngine, StaticStep | None]:
    pool = KVPool.for_model(model.config, model.dtype, torch.device("cpu"), ResidentMeter(None, "the test's device", ""))
    step = StaticStep(model, pool, graphs=False) if static else None  # eager: the step a CUDA graph captures
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name="tiny", device=torch.device("cpu"), dtype=model.dtype,
                         load_s=0.0)
    engine = BatchEngine(loaded, SummarizeConfig(**PLAIN, loop_stop=NO_LOOP_STOP), "auto",
                         len(prompts), BIG, _is_memory_error, prefill_chunk_tokens=CHUNK, static=step)
    try:
        got = [g.tokens for g in run_batch(engine, model, strategies, tmp_path, prompts, new, kv_pool=pool)]
    finally:
        engine.close()
    return got, engine, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_riding_prompts_leave_the_decode_rows_on_the_static_step(dtype: torch.dtype, tokenizer, tmp_path: Path
                                                                  ) -> None:
    """Two long prompts join one by one while the others decode: every chunk of theirs rode a step, and
    every decode row-step of every sequence went through the static step, with today's tokens."""
    model = tiny_model("llama-gqa", dtype)
    prompts = [random_prompt(n)[0].tolist() for n in (9, 30, 100, 75)]
    new = [60, 50, 12, 20]
    today, eager_engine, _ = _run(model, tokenizer, tmp_path, ["dynamic"] * 4, prompts, new, static=False)
    got, engine, step = _run(model, tokenizer, tmp_path, ["dynamic"] * 4, prompts, new, static=True)
    assert got == today
    if dtype == torch.float32:
        assert got == [tokens_alone(model, p, n, NO_LOOP_STOP) for p, n in zip(prompts, new)]
    assert engine.plan.steps_with_prefill == eager_engine.plan.steps_with_prefill > 0  # the chunks rode the steps
    assert step is not None and step.passenger_steps > 0  # a riding prompt's slot, no row of the step
    assert engine.plan.eager_row_steps == {} and engine.plan.static_row_steps == sum(len(t) - 1 for t in got)
    assert eager_engine.plan.eager_row_steps == {Eager.OFF: sum(len(t) - 1 for t in got)}


def test_tiered_rows_run_beside_the_static_step_and_the_pool_rows_stay_on_it(tokenizer, tmp_path: Path) -> None:
    """Pool rows and tiered rows (a batched group of their own) decode together, a prompt riding too:
    the pool rows' every row-step went through the static step, the tiered rows' ran eagerly ("not
    pool"), and every sequence has its tokens alone."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in (37, 20, 51, 9, 44)]
    new = [12, 20, 7, 16, 40]
    strategies = ["dynamic", "tiered-host", "dynamic", "tiered-disk", "dynamic"]
    got, engine, step = _run(model, tokenizer, tmp_path, strategies, prompts, new, static=True)
    assert got == [tokens_alone(model, p, n, NO_LOOP_STOP) for p, n in zip(prompts, new)]
    pooled = [len(t) - 1 for t, s in zip(got, strategies) if s == "dynamic"]
    tiered = [len(t) - 1 for t, s in zip(got, strategies) if s != "dynamic"]
    assert engine.plan.static_row_steps == sum(pooled) and engine.plan.eager_row_steps == {Eager.NOT_POOL: sum(tiered)}
    assert engine.plan.most_rows == 5 and step is not None and step.steps >= max(pooled)


def test_a_documents_passes_fold_into_one_outcome_their_row_steps_added_and_the_share_of_them_all() -> None:
    chunk, merge, read_back = kept_pass("t1", "a"), kept_pass("t1", "b"), kept_pass("t1", "c")
    merge.update(level=1, text="One sentence. And a cut", stop_reason="length", tokens=[1, 2, 3], decode_s=2.0)
    ran: dict[str, CallOutcome] = {
        "a": {"status": "done", "decode_row_steps": {"static": 50, "eager": {Eager.NOT_POOL: 20}},  # an older line
              "offload_bytes_written": 10, "kv_bytes": 5, "fallbacks": ["cache x"]},
        "b": {"status": "done", "decode_row_steps": {"static": 30, "eager": {}, "ahead": 25}, "static_step_share": 1.0,
              "offload_bytes_written": 4, "kv_bytes": 9, "cache_strategy": "dynamic", "fallbacks": ["cache x"]},
    }
    folded = fold_passes([read_back, chunk, merge], ran, chunks=2, input_tokens=900, worker={"model": "m"}, trim=True)
    assert folded["decode_row_steps"] == {"static": 80, "eager": {"not pool": 20}, "ahead": 25}
    assert folded["static_step_share"] == 0.8 and ran["b"]["static_step_share"] == 1.0
    assert (folded["summary"], folded["summary_tail"]) == ("One sentence.", " And a cut")
    assert (folded["passes"], folded["passes_reused"], folded["chunks"]) == (3, 1, 2)
    assert folded["offload_bytes_written"] == 14 and folded["kv_bytes"] == 9 and folded["fallbacks"] == ["cache x"]
    assert folded["cache_strategy"] == "dynamic" and folded["model"] == "m" and folded["ttft_s"] == 0.5
    assert folded["decode_s"] == 3.0 and folded["decode_tokens_per_s"] == 2 / 3.0  # the passes run, not the one read back
    assert static_share({"static": 0, "eager": {}, "ahead": 0}) is None
