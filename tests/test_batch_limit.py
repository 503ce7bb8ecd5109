"""A memory error lowers a worker's batch limit for a while, not for the rest of its life.

The rule (jobs.batch_limit): the limit halves on a memory error and doubles back after
`GROW_BACK_STEPS` decode steps without one, up to `batch.max_sequences`; each further memory error
doubles that wait. Shown on the policy alone and on the real engine, where the memory comes
back after a split (the worker's device pool grows, as when another process frees the GPU).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from jobs.batch_limit import GROW_BACK_STEPS, MAX_GROW_BACK_STEPS, BatchLimit
from jobs.config import LoopStopConfig, SummarizeConfig
from jobs.kvplan import kv_bytes
from runner.engine.batch_engine import BatchEngine
from runner.engine.kvcache import ResidentMeter, kv_shape
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, LENGTHS, PLAIN, as_loaded_model, run_batch, tokens_alone
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _steps(limit: BatchLimit, n: int) -> None:
    for _ in range(n):
        limit.step()


def test_the_limit_doubles_back_after_calm_steps_up_to_the_configured_value() -> None:
    limit = BatchLimit(8)
    limit.lower_to(8 // 2 // 2)  # a split of a batch of 4
    _steps(limit, GROW_BACK_STEPS - 1)
    assert limit.current == 2
    _steps(limit, 1)
    assert limit.current == 4
    _steps(limit, GROW_BACK_STEPS)
    assert limit.current == 8
    _steps(limit, 10 * GROW_BACK_STEPS)
    assert limit.current == 8  # never past what the config asks


def test_each_memory_error_doubles_the_wait_up_to_a_cap() -> None:
    limit = BatchLimit(16, grow_back_steps=4)
    waits = []
    for _ in range(12):
        limit.lower_to(1)
        waits.append(limit.wait_steps)
    assert waits[:4] == [4, 8, 16, 32] and waits[-1] == MAX_GROW_BACK_STEPS
    _steps(limit, MAX_GROW_BACK_STEPS)
    assert limit.current == 2


@pytest.mark.parametrize("wanted", [0, -3])
def test_the_limit_is_at_least_one(wanted: int) -> None:
    limit = BatchLimit(4)
    limit.lower_to(wanted)
    assert limit.current == 1


def test_a_split_batch_grows_back_when_memory_is_there_again(tokenizer, tmp_path: Path) -> None:
    """The worker's device pool holds about two sequences, so four decoding together split (limit 2).
    Then the memory comes back: after GROW_BACK_STEPS calm steps the limit is 4 again, and the two
    sequences that waited decode beside the first two, each with its tokens alone."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(n)[0].tolist() for n in LENGTHS[:4]]
    new = [2 * GROW_BACK_STEPS + 40] * 4
    full = kv_bytes(kv_shape(model.config), max(LENGTHS[:4]) + new[0])
    pool = ResidentMeter(int(2.5 * full), "the batch's resident device", "cache.device_kv_budget_bytes")
    no_loop_stop = LoopStopConfig(enabled=False)  # the random model loops: every sequence runs its full length
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN, loop_stop=no_loop_stop), "auto", 4,
                               BIG, _is_memory_error)

    limit_after_split: list[int] = []

    def memory_comes_back() -> None:
        deadline = time.monotonic() + 60
        while engine.plan.splits == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        limit_after_split.append(engine.plan.limit.current)
        pool.budget_bytes = BIG

    watcher = threading.Thread(target=memory_comes_back, daemon=True)
    watcher.start()
    try:
        got = run_batch(engine, model, "dynamic", tmp_path, prompts, new, pool=pool)
    finally:
        engine.close()
    watcher.join(timeout=10)
    assert limit_after_split == [2] and engine.plan.splits == 1
    assert engine.plan.limit.current == 4
    # the two that waited for room joined the first two once the limit was back at 4
    assert min(g.batch_size for g in got[2:]) > 2, [g.batch_size for g in got]
    assert [g.tokens for g in got] == [tokens_alone(model, p, n, no_loop_stop) for p, n in zip(prompts, new)]
