"""The static step reads each row's KV about in proportion to its own length (issue 48): a batch of
mixed lengths is attended in runs of slots (runner/engine/static_step.py `STEP_RUNS`), each up to its
own longest row, not every slot up to the longest. The reads are the keys of the SDPA kernels the step
really dispatches (a `TorchDispatchMode`), against the rows' own tokens, side by side with the step in
one call a layer (`most_runs=1`, the step before); the tokens are each row's alone either way."""

from __future__ import annotations

import pytest
import torch

from jobs.config import LoopStopConfig
from runner.engine.kvcache.pool import PooledCache
from runner.engine.static_step import STEP_RUNS, StaticStep
from tests.helpers.batching import AttentionKeys, cpu_kv_pool, tokens_alone
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [4500, 200, 3050, 375, 7500, 650, 100, 5500, 1500, 275, 3800, 50, 6500, 1000, 2250, 450]
"""Sixteen prompts of 50 to 7,500 tokens, long and short alternating in the order they joined (their slots)."""
STEPS = 12


def _decode(model, most_runs: int) -> tuple[list[list[int]], float, int]:
    """Every prompt prefilled into its slot, then STEPS static steps of all of them: each row's tokens,
    the keys the steps' attention kernels read over the keys the rows own, and the most kernels a layer."""
    pool = cpu_kv_pool(model)
    caches, tokens = [], []
    for length in LENGTHS:
        prompt = random_prompt(length)[0].tolist()
        cache = PooledCache(pool, length + STEPS + 1)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        caches.append(cache)
        tokens.append([int(logits[0, -1].argmax())])
    step = StaticStep(model, pool, graphs=False, most_runs=most_runs)
    read = owned = calls = 0
    for _ in range(STEPS):
        owned += sum(cache.length + 1 for cache in caches) * model.config.num_hidden_layers
        with AttentionKeys() as seen:
            _, chosen = step.run([t[-1] for t in tokens], caches)
        read += sum(keys[0] * keys[2] for keys in seen.keys)  # rows x tokens each kernel was handed
        calls = max(calls, len(seen.keys) // model.config.num_hidden_layers)
        for row, token in enumerate(chosen.tolist()):
            tokens[row].append(token)
    for cache in caches:
        cache.close()
    assert step.steps == STEPS
    return tokens, read / owned, calls


def test_a_mixed_length_batch_reads_its_keys_in_proportion_to_its_rows_own_lengths() -> None:
    model = tiny_model("llama-gqa")
    runs, runs_ratio, runs_calls = _decode(model, STEP_RUNS)
    one, one_ratio, one_calls = _decode(model, 1)
    alone = [tokens_alone(model, random_prompt(n)[0].tolist(), STEPS + 1, LoopStopConfig(enabled=False))
             for n in LENGTHS]
    assert runs == alone and one == alone
    assert one_calls == 1 and one_ratio >= 2.0, one_ratio  # every row read up to the 1,500-token one
    assert 1 < runs_calls <= STEP_RUNS and runs_ratio <= 1.25, (runs_ratio, runs_calls)
