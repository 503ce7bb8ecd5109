"""Layer-major prefill: each layer's K/V for the whole prompt is computed first, then stored once.

Chunked prefill brings an offloaded layer's earlier chunks back for every new chunk; going layer by layer
writes the prompt's KV once, with logits, K/V and tokens bit for bit chunked prefill's (docs/kv-cache.md,
"Layer-major prefill"; tests/test_layer_major.py). generate() then only decodes (`prefilled`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    get_layer_types_and_kwargs,
)
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from jobs.config import PrefillMode

log = logging.getLogger(__name__)

COVERED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma2")
"""Decoder-only models whose forward is embed_tokens -> rotary_emb -> layers (one mask per layer
type: full or sliding) -> norm; layer_major_prefill drives those same modules."""
_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
MIN_CHUNKS = 2
"""With one chunk there is nothing to read back: both orders are the same."""


def unsupported_reason(model: PreTrainedModel, cache: Cache) -> str | None:
    """Why layer-major prefill cannot fill `cache` for `model` exactly as chunked prefill would; None if it can."""
    model_type = model.config.model_type
    if model_type not in COVERED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {list(COVERED_MODEL_TYPES)}"
    decoder = getattr(model, "model", None)
    missing = [name for name in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(decoder, name)]
    if missing:
        return f"{type(model).__name__}.model has no {missing}"
    layer_types, _ = get_layer_types_and_kwargs(decoder.config)
    other_types = sorted(set(layer_types) - set(_MASKS))
    if other_types:
        return f"layer types {other_types} (covered: {list(_MASKS)})"
    if cache.get_seq_length() != 0:
        return "the cache already holds tokens"
    for idx, layer in enumerate(cache.layers[: len(layer_types)]):
        if getattr(layer, "is_compileable", True):  # transformers' flag of a fixed-size (static) or dummy layer
            return f"cache layer {idx} is a {type(layer).__name__} (covered: layers that grow as they are written)"
    return None


def choose_prefill(
    mode: PrefillMode, model: PreTrainedModel, cache: object, prompt_tokens: int, chunk_size: int
) -> Literal["chunked", "layer-major"]:
    """What `cache.prefill` means for one generate() call (docs/kv-cache.md, "Layer-major prefill"):
    `auto` goes layer-major only where reading streamed layers back is what costs; a model or cache it
    cannot fill falls back to chunked, the reason logged."""
    if mode == "chunked" or chunk_size <= 0:
        return "chunked"
    if mode == "auto":
        offloads = any(getattr(layer, "streamed", False) for layer in getattr(cache, "layers", ()))
        if not offloads or math.ceil(prompt_tokens / chunk_size) < MIN_CHUNKS:
            return "chunked"
    reason = (unsupported_reason(model, cache) if getattr(cache, "layers", None) is not None
              else "generate() builds this cache itself (cache_implementation)")
    if reason is not None:
        log.log(logging.WARNING if mode == "layer-major" else logging.INFO,
                "layer-major prefill not used (%s): chunked prefill instead", reason)
        return "chunked"
    return "layer-major"


@torch.no_grad()
def layer_major_prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Cache,
    chunk_size: int,
) -> CausalLMOutputWithPast:
    """Put the whole prompt's K/V into `cache`, a layer at a time over chunks of `chunk_size`, and
    return the output chunked prefill would end with (the last token's logits). Hand it to
    generate() with `prefilled`. Check `unsupported_reason` first."""
    decoder = model.model
    config = decoder.config
    # generate()'s own position ids and mask form: positions count the real tokens of each row, and
    # a mask without padding is dropped (so the first chunk may skip its causal mask, as it does there)
    positions = model._prepare_position_ids_for_generation(input_ids, {"attention_mask": attention_mask})
    padding_mask = None if bool((attention_mask == 1).all()) else attention_mask
    bounds = [(start, start + chunk_size) for start in range(0, input_ids.shape[1], chunk_size)]
    hidden = [decoder.embed_tokens(input_ids[:, start:end]) for start, end in bounds]
    rotary = [decoder.rotary_emb(h, positions[:, start:end]) for h, (start, end) in zip(hidden, bounds)]
    layer_types, _ = get_layer_types_and_kwargs(config)

    for idx, layer in enumerate(decoder.layers[: config.num_hidden_layers]):
        resident = not getattr(cache.layers[idx], "streamed", False)
        # A resident layer grows in the cache itself, as in chunked prefill; an offloaded one in a
        # fresh DynamicCache's layer `idx` (what chunked prefill would attend to), handed over below.
        target = cache if resident else DynamicCache(config=config)
        make_mask = _MASKS[layer_types[idx]]
        for chunk, (start, end) in enumerate(bounds):
            # the mask is sized by this layer's own state, which is every same-type layer's state
            # at this chunk in chunked prefill (where masks are sized by the first layer of a type)
            mask = make_mask(
                config=config,
                inputs_embeds=hidden[chunk],
                attention_mask=padding_mask[:, :end] if padding_mask is not None else None,
                past_key_values=target,
                position_ids=positions[:, start:end],
                layer_idx=idx,
            )
            hidden[chunk] = layer(
                hidden[chunk],
                attention_mask=mask,
                position_embeddings=rotary[chunk],
                position_ids=positions[:, start:end],
                past_key_values=target,
            )
        if not resident:
            staged = target.layers[idx]
            cache.update(staged.keys, staged.values, idx)
    # the model's own head, as generate() runs it: final norm over the chunk, the last position kept
    logits = model.lm_head(slice_logits_to_keep(decoder.norm(hidden[-1]), 1))
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


@contextmanager
def prefilled(model: PreTrainedModel, output: CausalLMOutputWithPast) -> Iterator[None]:
    """Within the block, the model's next generate() takes `output` as its prefill and only decodes."""

    def hand_over(*args: Any, **kwargs: Any) -> CausalLMOutputWithPast:
        del model._prefill  # once: any later forward pass is a real one
        return output

    model._prefill = hand_over
    try:
        yield
    finally:
        model.__dict__.pop("_prefill", None)
