"""One `model.generate` call, timed: time to first token and decode rate come from a streamer.

The prompt is prefilled in chunks of `summarize.prefill_chunk_size`, token-major (transformers') or,
for tiered caches, layer-major first (`cache.prefill`, runner/kvcache/layer_major.py): same tokens.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from jobs.config import PrefillMode, SummarizeConfig
from runner.kvcache.layer_major import choose_prefill, layer_major_prefill, prefilled
from runner.models import LoadedModel


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    input_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def output_tokens(self) -> int:
        return len(self.tokens)


class _TokenClock(BaseStreamer):
    """generate() calls put() once with the prompt, then once per new token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self._calls = 0

    def put(self, value: torch.Tensor) -> None:
        self._calls += 1
        if self._calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def generate_once(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    settings: SummarizeConfig,
    cache_kwargs: dict[str, Any],
    prefill: PrefillMode = "auto",
) -> Generation:
    """Greedy or seeded-sampling generation of one prompt with the cache the caller chose."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    attention_mask = torch.ones_like(input_ids)
    chunk_size = settings.prefill_chunk_size
    cache = cache_kwargs.get("past_key_values")
    layer_major = choose_prefill(prefill, loaded.model, cache, len(prompt_ids), chunk_size) == "layer-major"
    if settings.do_sample:
        torch.manual_seed(settings.seed)
    clock = _TokenClock()
    with torch.inference_mode(), ExitStack() as stack:
        if layer_major:  # generate() takes the filled cache and the last token's logits, and decodes
            output = layer_major_prefill(loaded.model, input_ids, attention_mask, cache, chunk_size)
            stack.enter_context(prefilled(loaded.model, output))
        out = loaded.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=settings.do_sample,
            prefill_chunk_size=chunk_size or None,
            pad_token_id=loaded.tokenizer.pad_token_id,
            streamer=clock,
            **settings.generation,  # GenerationConfig fields checked at submit (runner/preflight.py)
            **cache_kwargs,
        )
    end = time.perf_counter()
    new_tokens = out[0, input_ids.shape[1] :].tolist()
    first = clock.first_token_at or end
    return Generation(
        tokens=new_tokens,
        input_tokens=len(prompt_ids),
        ttft_s=first - clock.start,
        decode_s=end - first,
    )
