"""The pooled step's attention runs (runner/engine/pooled_attention.py): rows of very different lengths
are attended in a few calls per layer, each reading up to its own run's longest row, and still get
exactly their tokens alone; rows of like lengths stay one call per layer, up to the longest row.

The attention calls are seen where they really run: a `TorchDispatchMode` records the keys of every
SDPA kernel the step dispatches.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from jobs.config import LoopStopConfig
from runner.engine import ragged
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.pooled_attention import MOST_RUNS, RUN_TOKENS, aligned, attention_runs
from tests.helpers.batching import AttentionKeys, cpu_kv_pool, tokens_alone
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_LOOP_STOP = LoopStopConfig(enabled=False)
STEPS = 10


def _decode(model: PreTrainedModel, pool: KVPool, prompts: list[list[int]], sitting_out: list[int] | None = None
            ) -> tuple[list[list[int]], list[list]]:
    """Each prompt prefilled into its own slot (in order), then STEPS pooled steps of all of them: every
    row's greedy tokens, and each step's attention keys. `sitting_out`, prefilled last, holds a slot
    but takes no step (as a sequence does while its prompt rides in chunks)."""
    caches, tokens = [], []
    for prompt in prompts + ([sitting_out] if sitting_out else []):
        cache = PooledCache(pool, len(prompt) + STEPS + 1)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        caches.append(cache)
        tokens.append([int(logits[0, -1].argmax())])
    idle = [caches.pop(), tokens.pop()] if sitting_out else []
    steps = []
    for _ in range(STEPS):
        seen = AttentionKeys()
        with seen:
            logits = ragged.decode_step(model, [t[-1] for t in tokens], [c.length for c in caches], caches)
        steps.append(seen.keys)
        for row, token in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(token)
    for cache in caches + idle[:1]:
        cache.close()
    return tokens, steps


def test_rows_far_apart_in_length_attend_in_runs_with_their_tokens_alone() -> None:
    """A long prompt in slot 0 beside eleven short ones: two calls per layer, the long row's up to its
    length and the short rows' up to theirs, instead of every row reading 200 tokens."""
    model = tiny_model("llama-gqa")
    text = model.config
    kv_heads, head_dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    prompts = [random_prompt(n)[0].tolist() for n in (200, *range(5, 16))]
    pool = cpu_kv_pool(model)
    got, steps = _decode(model, pool, prompts)
    assert got == [tokens_alone(model, p, STEPS + 1, NO_LOOP_STOP) for p in prompts]
    for step, keys in enumerate(steps):  # the long row attends 201 tokens at its first step, the short ones 16 (each read up to the granule)
        assert keys == [(1, kv_heads, aligned(201 + step), head_dim), (11, kv_heads, aligned(16 + step), head_dim)] * text.num_hidden_layers
    assert pool.most_runs == 2 and pool.most_rows == 12 and pool.meter.total == 0


def test_a_long_row_among_short_ones_and_a_slot_sitting_out_attend_in_three_runs() -> None:
    """The long row in the middle of the slots is a run of its own; the slot that takes no step (its
    query scattered in, its output dropped: the step is not packed) rides in the last run."""
    model = tiny_model("llama-gqa")
    text = model.config
    kv_heads, head_dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    prompts = [random_prompt(n)[0].tolist() for n in (*range(5, 12), 200, *range(12, 20))]
    pool = cpu_kv_pool(model)
    got, steps = _decode(model, pool, prompts, sitting_out=random_prompt(30)[0].tolist())
    assert got == [tokens_alone(model, p, STEPS + 1, NO_LOOP_STOP) for p in prompts]
    for step, keys in enumerate(steps):  # the slot sitting out is read for one token, whatever it holds
        assert keys == [(7, kv_heads, aligned(12 + step), head_dim), (1, kv_heads, aligned(201 + step), head_dim),
                        (9, kv_heads, aligned(20 + step), head_dim)] * text.num_hidden_layers
    assert pool.most_runs == 3 and pool.most_rows == 16 and pool.meter.total == 0


def test_rows_of_like_lengths_attend_in_one_call_per_layer_up_to_the_longest() -> None:
    """Up to the longest row's length aligned to the span granule, with the KV heads as they are (no repeat_kv)."""
    model = tiny_model("llama-gqa")
    text = model.config
    prompts = [random_prompt(n)[0].tolist() for n in range(20, 28)]
    pool = cpu_kv_pool(model)
    got, steps = _decode(model, pool, prompts)
    assert got == [tokens_alone(model, p, STEPS + 1, NO_LOOP_STOP) for p in prompts]
    head_dim = text.hidden_size // text.num_attention_heads
    for step, keys in enumerate(steps):
        assert keys == [(8, text.num_key_value_heads, aligned(28 + step), head_dim)] * text.num_hidden_layers
    assert pool.most_runs == 1 and pool.most_rows == 8


def _reads(runs: list[tuple[int, int, int]]) -> int:
    """What a cut costs: the token-rows its calls read, and RUN_TOKENS a call after the first."""
    return sum((end - start) * span for start, end, span in runs) + RUN_TOKENS * (len(runs) - 1)


def _every_cut(attended: list[int]) -> list[list[tuple[int, int, int]]]:
    count = len(attended)
    cuts = []
    for runs in range(1, min(MOST_RUNS, count) + 1):
        for inner in itertools.combinations(range(1, count), runs - 1):
            bounds = [0, *inner, count]
            cuts.append([(a, b, max(attended[a:b])) for a, b in itertools.pairwise(bounds)])
    return cuts


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=9))
def test_the_runs_are_the_cheapest_cut_of_the_slots(attended: list[int]) -> None:
    runs = attention_runs(attended)
    assert [start for start, _, _ in runs] == [0, *(end for _, end, _ in runs[:-1])] and runs[-1][1] == len(attended)
    assert all(span == max(attended[start:end]) for start, end, span in runs) and len(runs) <= MOST_RUNS
    assert _reads(runs) == min(_reads(cut) for cut in _every_cut(attended))


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 4000))
def test_slots_of_one_length_are_one_run(count: int, length: int) -> None:
    assert attention_runs([length] * count) == [(0, count, length)]
