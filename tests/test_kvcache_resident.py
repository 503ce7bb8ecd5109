"""`dynamic` on GrowingLayer against transformers' plain DynamicCache: same tokens, same logits, O(n) copying.

The layer writes new KV in place into geometrically grown buffers and hands attention views; these
tests hold it to DynamicLayer's results bit for bit, and the budget guard to the real allocation.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from jobs.kvplan import kv_bytes
from runner.engine.kvcache import BudgetedDynamicCache, KVBudgetExceeded, kv_shape
from runner.engine.kvcache.resident import GRANULE_TOKENS, GROWTH, GrowingLayer, allocated_bytes
from tests.helpers.models import (
    ARCHS,
    assert_next_logits_equal,
    assert_tokens_of_dynamic,
    random_prompt,
    run_generate,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _check_growing_layers(
    model: PreTrainedModel, input_ids: torch.Tensor, inference_mode: bool = False, **kwargs: object
) -> None:
    """Greedy tokens and every step's logits equal to DynamicCache's; full-attention layers really grew."""
    plain = DynamicCache(config=model.config)
    cache = BudgetedDynamicCache(model.config)
    got, expected = assert_tokens_of_dynamic(model, cache, input_ids, "GrowingLayer", inference_mode, plain,
                                             return_dict_in_generate=True, output_logits=True, do_sample=False,
                                             **kwargs)
    assert len(got.logits) == len(expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits)), "GrowingLayer changed the logits"
    assert [isinstance(layer, GrowingLayer) for layer in cache.layers] == [
        type(layer) is DynamicLayer for layer in plain.layers
    ]
    for mine, theirs in zip(cache.layers, plain.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_and_logits_identical(arch: str) -> None:
    _check_growing_layers(tiny_model(arch), random_prompt(37))


def test_batch_of_two_with_left_padding() -> None:
    ids = random_prompt(30, batch=2)
    ids[1, :9] = 0  # the shorter document, left-padded
    mask = (torch.arange(30) >= 9).long().expand(2, -1).clone()
    mask[0] = 1
    _check_growing_layers(tiny_model("llama-gqa"), ids, attention_mask=mask)


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-sliding"])
def test_beam_search_three_beams(arch: str) -> None:
    _check_growing_layers(tiny_model(arch), random_prompt(29), num_beams=3, max_new_tokens=16)


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma2-alternating"])
def test_chunked_prefill(arch: str) -> None:
    _check_growing_layers(tiny_model(arch), random_prompt(53), prefill_chunk_size=11)


def test_under_inference_mode() -> None:
    """The worker generates under torch.inference_mode: the buffers are written in place there too."""
    _check_growing_layers(tiny_model("llama-gqa"), random_prompt(61), inference_mode=True, max_new_tokens=40)


def _prefilled_pair(model: PreTrainedModel, ids: torch.Tensor) -> tuple[DynamicCache, BudgetedDynamicCache]:
    plain, mine = DynamicCache(config=model.config), BudgetedDynamicCache(model.config)
    with torch.no_grad():
        for cache in (plain, mine):
            model(ids, past_key_values=cache)
    return plain, mine


def test_crop_then_regrow_matches_dynamic() -> None:
    """Cropped tokens stay in the buffer but out of sight; what replaces them is written over them."""
    model = tiny_model("llama-gqa")
    plain, mine = _prefilled_pair(model, random_prompt(60))
    for cache in (plain, mine):
        cache.crop(-25)
    assert mine.get_seq_length() == plain.get_seq_length() == 35
    assert_next_logits_equal(model, plain, mine, random_prompt(5))
    assert_next_logits_equal(model, plain, mine, random_prompt(40))  # 80 tokens: past the first capacity of 64


def test_batch_repeat_and_select_match_dynamic() -> None:
    """What contrastive and assisted decoding do to a cache: repeat rows, then keep some of them."""
    model = tiny_model("llama-gqa")
    plain, mine = _prefilled_pair(model, random_prompt(27, batch=2))
    for cache in (plain, mine):
        cache.batch_repeat_interleave(3)  # rows a a a b b b
        cache.batch_select_indices(torch.tensor([5, 0, 3]))  # rows b a b
    assert_next_logits_equal(model, plain, mine, random_prompt(4, batch=3))


def test_batch_repeat_is_checked_against_the_budget() -> None:
    """Repeated rows fill room that decoding would not grow: the guard must see them at once."""
    model = tiny_model("llama-gqa")
    allocated = kv_bytes(kv_shape(model.config, torch.float32), GRANULE_TOKENS)  # 27 tokens: one granule
    cache = BudgetedDynamicCache(model.config, device_budget_bytes=2 * allocated)
    with torch.no_grad():
        model(random_prompt(27), past_key_values=cache)
    assert cache.meter.total == allocated
    cache.batch_repeat_interleave(2)
    assert cache.meter.total == 2 * allocated
    with pytest.raises(KVBudgetExceeded):
        cache.batch_repeat_interleave(2)


def test_layer_contract_step_by_step() -> None:
    """Every CacheLayerMixin operation transformers uses, against DynamicLayer on the same tensors."""
    gen = torch.Generator().manual_seed(0)

    def kv(batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 2, tokens, 8, generator=gen), torch.randn(batch, 2, tokens, 8, generator=gen)

    mine, theirs = GrowingLayer(), DynamicLayer()
    assert mine.get_seq_length() == 0 and allocated_bytes(mine) == 0 and mine.get_max_length() == -1

    def both(operation: str, *args: object) -> None:
        results = [getattr(layer, operation)(*args) for layer in (mine, theirs)]
        if operation == "update":
            assert all(torch.equal(a, b) for a, b in zip(*results))
        assert mine.get_seq_length() == theirs.get_seq_length()
        assert mine.get_mask_sizes(3) == theirs.get_mask_sizes(3)
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)

    both("update", *kv(2, 70))
    both("crop", -30)
    both("update", *kv(2, 50))
    both("reorder_cache", torch.tensor([1, 1]))
    both("batch_repeat_interleave", 2)
    both("batch_select_indices", torch.tensor([3, 0, 2]))
    both("update", *kv(3, 1))
    assert allocated_bytes(mine) == mine.bytes_for(mine.capacity) > mine.keys.nbytes + mine.values.nbytes
    with pytest.raises(ValueError, match="positive value"):
        mine.crop(5)
    mine.reset()
    theirs.reset()
    assert mine.keys is None and mine.get_seq_length() == 0 and allocated_bytes(mine) == 0
    both("update", *kv(1, 9))


def test_decode_grows_geometrically_and_writes_in_place() -> None:
    """N single-token updates cause O(log N) reallocations and O(N) copied tokens; between two
    reallocations the returned keys are views of one buffer (no prefix copy)."""
    layer = GrowingLayer()
    keys, values = torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    layer.update(keys, values)
    steps = 3000
    reallocations = copied_tokens = 0
    for step in range(steps):
        before_ptr, before_len, before_cap = layer.keys.data_ptr(), layer.get_seq_length(), layer.capacity
        out_keys, _ = layer.update(torch.full((1, 2, 1, 8), float(step)), torch.zeros(1, 2, 1, 8))
        if layer.capacity != before_cap:
            reallocations += 1
            copied_tokens += before_len
            assert layer.capacity >= math.ceil(before_cap * GROWTH) and layer.capacity % GRANULE_TOKENS == 0
        else:
            assert out_keys.data_ptr() == before_ptr, "tokens appended without growth must not move the prefix"
    total = 100 + steps
    assert reallocations <= math.ceil(math.log(total / GRANULE_TOKENS, GROWTH)) + 1
    # lengths at growth form a geometric series (ratio >= GROWTH) ending below `total`; concatenation
    # would have copied the whole prefix at every step, about total**2 / 2 tokens
    assert copied_tokens <= total * GROWTH / (GROWTH - 1)
    assert torch.equal(layer.keys[0, 0, 100:, 0], torch.arange(steps, dtype=torch.float32))
    assert torch.equal(layer.keys[:, :, :100], keys)


def _budget_case(arch: str) -> tuple[PreTrainedModel, torch.Tensor, int, int]:
    """A prompt and length whose geometric capacity is well above `needed`: the guard's peak with
    transformers' own concatenating layers, i.e. the least budget plain DynamicCache runs in."""
    model = tiny_model(arch)
    ids, new_tokens = random_prompt(40), 12
    concatenating = BudgetedDynamicCache(model.config)
    concatenating.layers = [DynamicLayer() if isinstance(x, GrowingLayer) else x for x in concatenating.layers]
    run_generate(model, concatenating, ids, max_new_tokens=new_tokens)
    return model, ids, new_tokens, concatenating.meter.peak


def test_meter_counts_the_allocation_and_kv_bytes_the_tokens() -> None:
    model, ids, new_tokens, needed = _budget_case("llama-gqa")
    assert needed == kv_bytes(kv_shape(model.config, torch.float32), ids.shape[-1] + new_tokens - 1)
    cache = BudgetedDynamicCache(model.config)
    run_generate(model, cache, ids, max_new_tokens=new_tokens)
    allocated = sum(allocated_bytes(layer) for layer in cache.layers)
    assert cache.stats()["kv_bytes"] == needed
    assert cache.stats()["kv_resident_peak_bytes"] == allocated > needed


def test_a_known_task_length_is_allocated_once_without_slack() -> None:
    model, ids, new_tokens, needed = _budget_case("llama-gqa")
    expected_tokens = ids.shape[-1] + new_tokens
    plain = run_generate(model, DynamicCache(config=model.config), ids, max_new_tokens=new_tokens, prefill_chunk_size=8)
    cache = BudgetedDynamicCache(model.config, expected_tokens=expected_tokens)
    pointers = []

    def spy(*args: object, **kwargs: object) -> None:
        pointers.append(cache.layers[0].keys.data_ptr())

    hook = model.model.layers[1].register_forward_hook(spy)
    try:
        got = run_generate(model, cache, ids, max_new_tokens=new_tokens, prefill_chunk_size=8)
    finally:
        hook.remove()
    assert torch.equal(got, plain)
    assert len(set(pointers)) == 1, "the buffer was reallocated"
    assert [layer.capacity for layer in cache.layers] == [expected_tokens] * len(cache.layers)
    # the one token never cached is all the room left over
    assert cache.stats()["kv_resident_peak_bytes"] == needed * expected_tokens // (expected_tokens - 1)


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma2-alternating"])
def test_every_budget_between_needed_and_the_geometric_step_fits(arch: str) -> None:
    """Growth never takes budget plain DynamicCache would have fitted in: slack is given back instead
    (before a full-attention layer grows, and before a sliding layer's new tokens arrive)."""
    model, ids, new_tokens, needed = _budget_case(arch)
    unbudgeted = BudgetedDynamicCache(model.config)
    expected = run_generate(model, unbudgeted, ids, max_new_tokens=new_tokens)
    geometric = unbudgeted.stats()["kv_resident_peak_bytes"]
    assert geometric > needed
    for budget in range(needed, geometric, -(-(geometric - needed) // 8)):
        cache = BudgetedDynamicCache(model.config, device_budget_bytes=budget)
        got = run_generate(model, cache, ids, max_new_tokens=new_tokens)
        assert torch.equal(got, expected)
        assert cache.stats()["kv_bytes"] <= cache.stats()["kv_resident_peak_bytes"] <= budget


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma2-alternating"])
def test_budget_below_needed_raises(arch: str) -> None:
    model, ids, new_tokens, needed = _budget_case(arch)
    cache = BudgetedDynamicCache(model.config, device_budget_bytes=needed - 1)
    with pytest.raises(KVBudgetExceeded, match="device_kv_budget_bytes"):
        run_generate(model, cache, ids, max_new_tokens=new_tokens)
    assert cache.meter.peak <= needed - 1
