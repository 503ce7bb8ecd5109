"""One `model.generate` call, timed: time to first token and decode rate come from a streamer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from jobs.config import SummarizeConfig
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
) -> Generation:
    """Greedy or seeded-sampling generation of one prompt with the cache the caller chose."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    if settings.do_sample:
        torch.manual_seed(settings.seed)
    clock = _TokenClock()
    with torch.inference_mode():
        out = loaded.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=settings.do_sample,
            prefill_chunk_size=settings.prefill_chunk_size or None,
            pad_token_id=loaded.tokenizer.pad_token_id,
            streamer=clock,
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
