"""Tiny random transformers models and the reference they are held to: `generate()` with DynamicCache.

Token identity is the contract (docs/design.md), so every cache under test is compared with the
tokens plain transformers gives; the models are seeded, so each call builds the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

from jobs.kvplan import kv_bytes
from runner.engine.kvcache import BudgetedDynamicCache, TieredCache, kv_shape

VOCAB = 96
BLOCK = 8  # small blocks, so prompts span several sealed blocks plus a tail


def small_config(**extra: object) -> dict[str, object]:
    """The keyword arguments of a 4-layer, GQA model config small enough for a shared CPU."""
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=None, **extra,
    )


#: one architecture per kind of attention layout a cache must handle
ARCHS = {
    "llama-gqa": lambda: LlamaConfig(**small_config()),
    "qwen2-sliding": lambda: Qwen2Config(
        **small_config(use_sliding_window=True, sliding_window=12, max_window_layers=2)
    ),
    "gemma2-alternating": lambda: Gemma2Config(**small_config(head_dim=16, sliding_window=10)),
    "mistral-sliding": lambda: MistralConfig(**small_config(sliding_window=12)),
}


def tiny_model(arch: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A seeded random model of one of ARCHS: the same weights on every call."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS[arch](), dtype=dtype).eval()


def random_prompt(length: int, batch: int = 1) -> torch.Tensor:
    """Token ids seeded by `length`, so a test's prompts are the same every run."""
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


def strategy_cache(strategy: str, model: PreTrainedModel, tmp_path: Path, **budget: int) -> object:
    """The cache a strategy name (`dynamic`, `tiered-host`, `tiered-disk-zstd`, ...) stands for."""
    if strategy == "dynamic":
        return BudgetedDynamicCache(model.config, **budget)
    tier, _, compression = strategy.removeprefix("tiered-").partition("-")
    return TieredCache(
        model.config, tier=tier, offload_dir=tmp_path / "kv", block_tokens=BLOCK,
        compression=compression or "zstd", **budget,
    )


def run_generate(
    model: PreTrainedModel, cache: object | None, input_ids: torch.Tensor, inference_mode: bool = False,
    **kwargs: object,
) -> torch.Tensor:
    """`model.generate` on `cache` (24 new tokens unless told); sampling is seeded the same every call."""
    if kwargs.get("do_sample"):
        torch.manual_seed(1234)
    cache_kwargs = {"past_key_values": cache} if cache is not None else {}
    with torch.inference_mode() if inference_mode else torch.no_grad():
        return model.generate(
            input_ids, max_new_tokens=kwargs.pop("max_new_tokens", 24), **cache_kwargs, **kwargs
        )


def assert_tokens_of_dynamic(
    model: PreTrainedModel, cache: object, input_ids: torch.Tensor, what: str, inference_mode: bool = False,
    reference: DynamicCache | None = None, **kwargs: object,
) -> tuple[object, object]:
    """Generates on transformers' DynamicCache (or `reference`), then on `cache`; fails unless the tokens
    are identical. Returns (got, expected) for the caller's own checks."""
    reference = DynamicCache(config=model.config) if reference is None else reference
    expected = run_generate(model, reference, input_ids, inference_mode, **dict(kwargs))
    got = run_generate(model, cache, input_ids, inference_mode, **dict(kwargs))
    tokens, expected_tokens = getattr(got, "sequences", got), getattr(expected, "sequences", expected)
    assert tokens.shape == expected_tokens.shape
    assert torch.equal(tokens, expected_tokens), f"{what} differs from DynamicCache"
    return got, expected


def assert_next_logits_equal(model: PreTrainedModel, dynamic: DynamicCache, tiered: TieredCache,
                             follow: torch.Tensor) -> None:
    """The logits of `follow` are bit-identical on both caches."""
    with torch.no_grad():
        expected = model(follow, past_key_values=dynamic).logits
        got = model(follow, past_key_values=tiered).logits
    assert torch.equal(got, expected)


def layer_bytes(model: PreTrainedModel, tokens: int, batch: int = 1) -> int:
    """One layer's fp32 KV bytes for `tokens` tokens of `batch` rows."""
    shape = kv_shape(model.config, torch.float32)
    return kv_bytes(shape, tokens, batch) // shape.num_layers
