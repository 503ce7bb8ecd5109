"""Layer-major prefill against transformers' chunked prefill, on tiny random models.

The contract: the same logits, K/V and tokens bit for bit as generate(prefill_chunk_size=c), and a
tiered cache that writes the prompt's KV once and reads none of it back during prefill, where
chunked prefill reads every layer's prefix back for each later chunk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, PreTrainedModel

from jobs.config import SummarizeConfig
from runner.engine.generation import generate_once
from runner.engine.kvcache import TieredCache
from runner.engine.kvcache.layer_major import (
    choose_prefill,
    layer_major_prefill,
    prefilled,
    unsupported_reason,
)
from runner.engine.model_loader import LoadedModel
from tests.helpers.models import BLOCK, layer_bytes, random_prompt, strategy_cache, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 11
NEW_TOKENS = 8


def _padded_prompt(length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` rows; the second one a shorter document, left-padded."""
    ids = random_prompt(length, batch)
    mask = torch.ones_like(ids)
    if batch == 2:
        ids[1, :9] = 0
        mask[1, :9] = 0
    return ids, mask


def _generate(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, cache: object, **kwargs: object):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, past_key_values=cache, prefill_chunk_size=CHUNK, do_sample=False,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )


def _layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K/V as attention sees them; an offloaded layer is read back to do that."""
    if getattr(layer, "store", None) is not None:
        resident = layer.store.load(extra_tokens=0)
        return resident.keys, resident.values
    return layer.keys, layer.values


@pytest.mark.parametrize("strategy", ["dynamic", "tiered-host", "tiered-disk-zstd", "tiered-disk-none"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-sliding", "gemma2-alternating", "mistral-sliding"])
def test_bit_identical_to_chunked_prefill(arch: str, batch: int, strategy: str, tmp_path: Path) -> None:
    """53 tokens in chunks of 11 (the last one 9 tokens), all layer-major; generate() only decodes.
    The sliding windows (10-12 tokens) are far shorter than the prompt."""
    model = tiny_model(arch)
    ids, mask = _padded_prompt(53, batch)
    expected_cache = DynamicCache(config=model.config)
    expected = _generate(model, ids, mask, expected_cache, max_new_tokens=NEW_TOKENS)
    cache = strategy_cache(strategy, model, tmp_path)
    try:
        assert unsupported_reason(model, cache) is None
        output = layer_major_prefill(model, ids, mask, cache, CHUNK)
        assert cache.get_seq_length() == 53
        with prefilled(model, output):
            got = _generate(model, ids, mask, cache, max_new_tokens=NEW_TOKENS)
        assert "_prefill" not in model.__dict__, "the hand-over is for one generate() only"
        assert torch.equal(got.sequences, expected.sequences)
        assert len(got.logits) == len(expected.logits) == NEW_TOKENS
        for step, (got_logits, expected_logits) in enumerate(zip(got.logits, expected.logits)):
            assert torch.equal(got_logits, expected_logits), f"step {step} (0: the prompt's last token)"
        for idx, (got_layer, expected_layer) in enumerate(zip(cache.layers, expected_cache.layers)):
            for got_kv, expected_kv in zip(_layer_kv(got_layer), _layer_kv(expected_layer)):
                assert torch.equal(got_kv, expected_kv), f"layer {idx}"
    finally:
        cache.close()


def test_disk_tier_writes_the_prompt_once_and_reads_none_of_it_back(tmp_path: Path) -> None:
    """69 tokens in chunks of 16 over blocks of 8, raw blocks: byte counts are KV sizes exactly.
    Chunked prefill reads every layer's prefix back for each later chunk (16+32+48+64 tokens);
    layer-major reads nothing while it fills the cache, except layer 0, which the cache prefetches
    for the first decode step as soon as the last layer is in (as it does after chunked prefill).
    Both write the 64 tokens of every layer's sealed blocks once (the 5 others stay in RAM tails)."""
    model = tiny_model("llama-gqa")
    layers = model.config.num_hidden_layers
    token = layer_bytes(model, 1)  # one token of one layer, keys and values
    ids = random_prompt(69)
    mask = torch.ones_like(ids)

    def disk_cache(name: str) -> TieredCache:
        return TieredCache(model.config, tier="disk", offload_dir=tmp_path / name, block_tokens=BLOCK, compression="none")

    with disk_cache("chunked") as chunked, disk_cache("layer-major") as layer_major:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, past_key_values=chunked, prefill_chunk_size=16, max_new_tokens=1)
        output = layer_major_prefill(model, ids, mask, layer_major, 16)
        with torch.no_grad(), prefilled(model, output):
            model.generate(ids, attention_mask=mask, past_key_values=layer_major, prefill_chunk_size=16, max_new_tokens=1)
        chunked_stats, layer_major_stats = chunked.stats(), layer_major.stats()

    one_copy = layers * 64 * token
    prefetch_of_layer_0 = 64 * token
    assert layer_major_stats["offload_bytes_written"] == chunked_stats["offload_bytes_written"] == one_copy
    assert layer_major_stats["offload_bytes_read"] == prefetch_of_layer_0
    assert chunked_stats["offload_bytes_read"] == layers * (16 + 32 + 48 + 64) * token + prefetch_of_layer_0


def test_written_bytes_are_the_raw_kv(tmp_path: Path) -> None:
    """What the disk tier writes with compression none is the K/V itself: the bytes of a DynamicCache
    holding the same tokens, for the tokens of its full blocks (the rest stays in the RAM tail)."""
    model = tiny_model("llama-gqa")
    ids, mask = _padded_prompt(49, 2)
    dynamic = DynamicCache(config=model.config)
    layer_major_prefill(model, ids, mask, dynamic, 16)
    raw = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    with TieredCache(model.config, tier="disk", offload_dir=tmp_path / "kv", block_tokens=BLOCK, compression="none") as cache:
        layer_major_prefill(model, ids, mask, cache, 16)
        assert cache.stats()["offload_bytes_written"] == raw // 49 * (49 // BLOCK * BLOCK)


def _tiny_gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_an_uncovered_architecture_falls_back_to_chunked_prefill(tiny_random: LoadedModel, tmp_path: Path,
                                                                 caplog) -> None:
    gpt2 = LoadedModel(_tiny_gpt2(), tiny_random.tokenizer, "gpt2-tiny", torch.device("cpu"), torch.float32, 0.0)
    settings = SummarizeConfig(prefill_chunk_size=CHUNK, max_new_tokens=NEW_TOKENS)
    prompt = random_prompt(53)[0].tolist()
    outputs = {}
    for mode in ("chunked", "layer-major"):
        with TieredCache(gpt2.model.config, tier="disk", offload_dir=tmp_path / mode, block_tokens=BLOCK) as cache:
            with caplog.at_level(logging.INFO, logger="runner.engine.kvcache.layer_major"):
                outputs[mode] = generate_once(gpt2, prompt, NEW_TOKENS, settings, {"past_key_values": cache}, mode)
            assert cache.stats()["offload_bytes_read"] > 0  # chunked prefill's read-backs
    assert outputs["layer-major"].tokens == outputs["chunked"].tokens
    fallbacks = [r.getMessage() for r in caplog.records if "layer-major prefill not used" in r.getMessage()]
    assert len(fallbacks) == 1 and "'gpt2'" in fallbacks[0]


@pytest.mark.parametrize("strategy", ["tiered-disk-zstd", "dynamic"])
def test_generate_once_prefill_modes_give_the_same_tokens(tiny_random: LoadedModel, strategy: str,
                                                          tmp_path: Path) -> None:
    """The worker's path: `cache.prefill` auto picks layer-major for a tiered cache (read-backs cut),
    chunked for dynamic (nothing to read back); every mode writes the same tokens."""
    settings = SummarizeConfig(prefill_chunk_size=16, max_new_tokens=NEW_TOKENS)
    prompt = list(range(100, 180))  # 5 chunks
    results = {}
    for mode in ("chunked", "layer-major", "auto"):
        cache = strategy_cache(strategy, tiny_random.model, tmp_path / mode)
        try:
            gen = generate_once(tiny_random, prompt, NEW_TOKENS, settings, {"past_key_values": cache}, mode)
            results[mode] = (gen.tokens, cache.stats().get("offload_bytes_read"))
        finally:
            cache.close()
    assert results["layer-major"][0] == results["chunked"][0] == results["auto"][0]
    if strategy == "dynamic":
        plain = DynamicCache(config=tiny_random.model.config)
        assert choose_prefill("auto", tiny_random.model, plain, 80, 16) == "chunked"
    else:
        assert results["auto"][1] == results["layer-major"][1] < results["chunked"][1]


def test_auto_keeps_chunked_prefill_for_one_chunk(tmp_path: Path) -> None:
    """One chunk: there is nothing to read back, both orders are the same."""
    model = tiny_model("llama-gqa")
    with TieredCache(model.config, tier="host") as cache:
        assert choose_prefill("auto", model, cache, 16, 16) == "chunked"
        assert choose_prefill("auto", model, cache, 17, 16) == "layer-major"
        assert choose_prefill("auto", model, cache, 33, 0) == "chunked"  # no chunks: one forward
        assert choose_prefill("chunked", model, cache, 330, 16) == "chunked"
